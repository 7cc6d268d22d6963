// A model vocabulary padded past its tokenizer's (model.vocab_size 4096 over a 300-token
// BPE, a GEMM-friendly size): the padded ids have no text, so nothing may ever choose one.
// The Generator is the one place tokens are chosen (the trainer's samples, `kiln sample`
// and `kiln serve` all go through it); these tests hold it to that, in process and through
// the real binary.
#include "export_fixture.h"
#include "fault_test_util.h"
#include "infer/generator.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace kiln {
namespace {

namespace fs = std::filesystem;

// 259 byte ids in a 4096-id model with random weights: a draw over all 4096 would land on
// a padded id 15 times in 16, and the greedy argmax almost surely.
TEST(PaddedVocab, GeneratorChoosesOnlyIdsTheTokenizerHas) {
  ModelConfig c = test::tiny_config(true, true, false);
  c.vocab_size = 4096;
  BuildOptions o;
  o.training = false;
  o.max_tokens = c.max_seq_len;
  Model model(c, o);
  model.allocate();
  test::randomize_weights(model, 11);
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 16;
  Decoder decoder(model, d);
  const ByteTokenizer tokenizer;
  Generator generator(decoder, tokenizer);
  std::vector<GenerationRequest> requests;
  for (const double temperature : {0.0, 1.0, 2.0}) {
    for (const bool logprobs : {false, true}) {
      GenerationRequest r;
      r.prompt = {ByteTokenizer::kBos, 'H', 'i'};
      r.max_tokens = 40;
      r.sampling.temperature = temperature;  // top_k 0: the whole vocabulary
      r.stop_at_eos = false;
      r.logprobs = logprobs;
      r.top_logprobs = logprobs ? 8 : 0;
      r.seed = requests.size();
      requests.push_back(r);
    }
  }
  const std::vector<GenerationResult> results = generator.run(requests);
  for (size_t i = 0; i < results.size(); ++i) {
    SCOPED_TRACE(fmt::format("temperature {}, logprobs {}", requests[i].sampling.temperature, requests[i].logprobs));
    ASSERT_EQ(results[i].tokens.size(), 40u);
    for (const int32_t t : results[i].tokens) EXPECT_LT(t, ByteTokenizer::kVocab);
    for (const TokenLogprob& lp : results[i].logprobs)
      for (const auto& [id, logprob] : lp.top) EXPECT_LT(id, ByteTokenizer::kVocab);
  }
  // A padded id is not a prompt either.
  GenerationRequest padded = requests[0];
  padded.prompt.push_back(300);
  EXPECT_THROW(generator.submit(padded, nullptr), Error);
}

// The whole path through the binary: a run with a 300-token BPE and 4096 ids trains, samples
// at the end, saves its model and final checkpoint and exits 0; `kiln sample` and `kiln
// serve` then sample from it.
TEST(PaddedVocab, TrainSampleAndServeAModelPaddedPastItsBpe) {
  const std::string dir = test::temp_dir("kiln-padded-vocab");
  const std::string corpus = test::write_tiny_corpus(dir, 40);
  std::string output;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " train-tokenizer " KILN_SOURCE_DIR
                                  "/data/tinyshakespeare.txt --vocab-size 300 --out " + dir + "/tok",
                              &output),
            0)
      << output;
  ASSERT_EQ(make_tokenizer("bpe", dir + "/tok/tokenizer.json")->vocab_size(), 300);

  const std::string run = dir + "/run";
  ASSERT_EQ(test::run_command(test::tiny_train(corpus, run,
                                               "--set model.vocab_size=4096 --set data.tokenizer=" + dir +
                                                   "/tok/tokenizer.json --set train.steps=4 --set "
                                                   "train.sample_tokens=24 --set train.sample_temperature=1.5 "
                                                   "--set train.sample_top_k=0"),
                              &output),
            0)
      << output;
  EXPECT_CONTAINS(output, "sample at step 4:");
  EXPECT_TRUE(fs::exists(run + "/model/model.safetensors")) << output;
  EXPECT_EQ(test::latest_of(run), "step-00000004");

  for (const char* temperature : {"0", "1.5"}) {
    ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + run + "/model -p 'the king' -n 30 -k 0 -t " +
                                    temperature + " --ignore-eos --seed 5",
                                &output),
              0)
        << output;
    EXPECT_EQ(output.rfind("the king", 0), 0u) << output;
  }

  test::ServeProcess serve(run + "/model", {"--threads", "1"}, dir);
  const int port = serve.wait_for_port();
  ASSERT_GT(port, 0) << serve.log();
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(30, 0);
  for (const char* body : {R"({"prompt": "the", "max_tokens": 30, "temperature": 1.5, "seed": 1, "logprobs": 5, "ignore_eos": true})",
                           R"({"prompt": "the", "max_tokens": 30, "temperature": 0})"}) {
    auto res = client.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(res) << body;
    EXPECT_EQ(res->status, 200) << body << " -> " << res->body;
  }
  EXPECT_EQ(serve.stop(), 0) << serve.log();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln
