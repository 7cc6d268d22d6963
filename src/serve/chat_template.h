// A model's chat template: the Jinja that turns chat messages into the prompt the model
// continues. A Hugging Face model brings its own in tokenizer_config.json ("chat_template");
// kiln's own models have none, and get kDefaultChatTemplate. Both are rendered by minja
// (Google's header-only Jinja subset, fetched by scripts/minja.sh), with Hugging Face's
// settings (trim_blocks, lstrip_blocks), `bos_token`, `eos_token`, `raise_exception` and
// `strftime_now`, and no polyfills: the prompt is what transformers' apply_chat_template
// makes. minja's header stays inside chat_template.cpp (it is 3000 lines).
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

namespace minja {
class chat_template;
}

namespace kiln::serve {

// kiln's plain template: each message as "<|role|>\n" + content + "\n", then "<|assistant|>\n".
inline constexpr const char* kDefaultChatTemplate =
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

class ChatTemplate {
 public:
  // kDefaultChatTemplate; the prompt gets BOS first (as kiln's models are trained).
  static ChatTemplate kiln_default();
  // `source` parsed now: a template that does not parse throws kiln::Error naming `origin`
  // (the file it came from) and the parser's first line. A Jinja template puts its own
  // bos_token where it wants one, so no BOS is added before it.
  static ChatTemplate jinja(const std::string& source, const std::string& bos_token, const std::string& eos_token,
                            const std::string& origin);
  // The template of the model in `model_dir`: `tokenizer_config_dir`/tokenizer_config.json's
  // chat_template (a string, or Hugging Face's list of {name, template}: "default") where
  // it has one, else kiln_default().
  static ChatTemplate for_model(const std::string& tokenizer_config_dir);

  // `messages` ([{role, content: string}]) with the generation prompt after them. A
  // template that fails (its raise_exception on an order of roles it refuses) throws
  // ApiError 400 naming 'messages'.
  std::string render(const nlohmann::json& messages) const;
  bool adds_bos() const { return adds_bos_; }
  const std::string& origin() const { return origin_; }

 private:
  std::shared_ptr<const minja::chat_template> template_;
  bool adds_bos_ = false;
  std::string origin_;
};

}  // namespace kiln::serve
