// Dynamic loss scaling (train/loss_scaler.h): the scale's rules; a run whose scale is a
// power of two and never overflows is the run without scaling, bit for bit; an overflow
// skips its step and halves the scale without counting as a fault; a resumed run scales
// as one that never stopped; a scale that is not a power of two is refused by key.
#include "fault_test_util.h"

#include "train/loss_scaler.h"

namespace kiln {
namespace {

using ops::StepVerdict;
using test::run_with_fault;
using test::tiny_train;

TrainConfig scaling(const std::string& mode, double init, int64_t interval) {
  TrainConfig c;
  c.loss_scale = mode;
  c.loss_scale_init = init;
  c.loss_scale_growth_interval = interval;
  return c;
}

TEST(LossScaler, OffIsAScaleOfOneThatNeverMoves) {
  LossScaler s(scaling("none", 1024, 2));
  EXPECT_FALSE(s.enabled());
  EXPECT_EQ(s.scale(), 1);
  EXPECT_FALSE(s.after_step(StepVerdict::non_finite_grad_norm));  // a fault for the guard
  for (int i = 0; i < 5; ++i) s.after_step(StepVerdict::apply);
  EXPECT_EQ(s.scale(), 1);
}

TEST(LossScaler, OverflowsHalveItAndCleanStepsDoubleIt) {
  LossScaler s(scaling("dynamic", 8, 3));
  EXPECT_EQ(s.scale(), 8);
  EXPECT_TRUE(s.after_step(StepVerdict::non_finite_grad_norm));
  EXPECT_EQ(s.scale(), 4);
  s.after_step(StepVerdict::apply), s.after_step(StepVerdict::apply);
  EXPECT_EQ(s.scale(), 4);
  EXPECT_FALSE(s.after_step(StepVerdict::loss_spike));  // another skip: no overflow, no clean step
  s.after_step(StepVerdict::apply);
  EXPECT_EQ(s.scale(), 8);  // three applied steps since the overflow
  for (const double want : {4.0, 2.0, 1.0}) {
    EXPECT_TRUE(s.after_step(StepVerdict::non_finite_grad_norm));
    EXPECT_EQ(s.scale(), want);
  }
  EXPECT_FALSE(s.after_step(StepVerdict::non_finite_grad_norm));  // at 1 nothing is left to back off: a fault
  EXPECT_EQ(s.scale(), 1);
  EXPECT_EQ(s.state().overflows, 4);
}

class LossScalingRun : public test::TinyRunTest {
 protected:
  LossScalingRun() : test::TinyRunTest("kiln-loss-scale", 40) {}
  std::string train(const std::string& name, const std::string& extra, const std::string& fault = "",
                    int want_exit = 0) {
    const std::string out = dir_ + "/" + name;
    std::string output;
    EXPECT_EQ(run_with_fault(tiny_train(corpus_, out, "--set optim.grad_clip=0.05 " + extra), fault, &output), want_exit)
        << output;
    return out;
  }
  static std::string model_bytes(const std::string& out) { return test::read_file(out + "/model/model.safetensors"); }
  static std::vector<double> scales(const std::string& out) {
    std::vector<double> s;
    for (const auto& j : test::metrics_of_kind(out, "train")) s.push_back(j.value("loss_scale", 0.0));
    return s;
  }
};

// Scaling by 2^10, doubling every third step, changes no bit of the run: losses, gradient
// norms (unscaled), the clipped updates and the final weights.
TEST_F(LossScalingRun, APowerOfTwoScaleTrainsBitForBitAsNoScale) {
  const std::string plain = train("plain", "");
  const std::string scaled =
      train("scaled", "--set train.loss_scale=dynamic --set train.loss_scale_init=1024 "
                      "--set train.loss_scale_growth_interval=3");
  EXPECT_EQ(test::train_records(scaled), test::train_records(plain));
  ASSERT_EQ(test::train_records(plain).size(), 12u);
  EXPECT_EQ(model_bytes(scaled), model_bytes(plain));
  const std::vector<double> s = scales(scaled);
  ASSERT_EQ(s.size(), 12u);
  EXPECT_EQ(s.front(), 1024);
  EXPECT_EQ(s.back(), 8192);  // doubled after steps 3, 6 and 9
  EXPECT_EQ(scales(plain), std::vector<double>(12, 0.0));  // no key without scaling
}

// The same with sparse layers and their router losses (the balance loss and the z-loss; the
// relu router's L1), whose gradients carry S as the LM head's do.
TEST_F(LossScalingRun, APowerOfTwoScaleTrainsMoeRouterLossesBitForBitAsNoScale) {
  const std::string moe = "--set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 "
                          "--set model.moe.expert_hidden=16 ";
  const std::string dynamic = "--set train.loss_scale=dynamic --set train.loss_scale_init=1024 "
                              "--set train.loss_scale_growth_interval=3";
  for (const auto& [name, losses] :
       {std::pair<std::string, std::string>{"topk", "--set model.moe.aux_loss=0.5 --set model.moe.z_loss=0.2 "},
        std::pair<std::string, std::string>{"relu", "--set model.moe.router=relu --set model.moe.aux_loss=0 "
                                                    "--set model.moe.l1_coef=0.05 "}}) {
    const std::string plain = train(name + "-plain", moe + losses);
    const std::string scaled = train(name + "-scaled", moe + losses + dynamic);
    ASSERT_EQ(test::train_records(plain).size(), 12u) << name;
    EXPECT_EQ(test::train_records(scaled), test::train_records(plain)) << name;
    EXPECT_EQ(model_bytes(scaled), model_bytes(plain)) << name;
    EXPECT_EQ(scales(scaled).back(), 8192) << name;
  }
}

// A scale far too large (2^140: the LM head's gradient rows alone overflow fp32) skips
// steps and halves until the gradients are finite, and the guard, which would stop the run
// after two faults in a row here, does not count them.
TEST_F(LossScalingRun, OverflowsHalveTheScaleWithoutStoppingTheRun) {
  const std::string out = train("overflow", "--set train.loss_scale=dynamic --set train.loss_scale_init=1.393796574908164e42 "
                                            "--set train.max_consecutive_skips=2 --set train.steps=40");
  const auto skips = test::metrics_of_kind(out, "skip");
  ASSERT_GE(skips.size(), 3u);
  // The overflows come first, one step each, each at half the scale of the one before.
  double scale = 0x1p140;
  for (size_t i = 0; i < skips.size(); ++i) {
    EXPECT_EQ(skips[i]["step"].get<int64_t>(), static_cast<int64_t>(i) + 1);
    EXPECT_EQ(skips[i]["reason"].get<std::string>(),
              fmt::format("gradient overflow at loss scale {}; the scale is now {}", scale, scale / 2));
    scale /= 2;
  }
  // Every step is logged; from the first applied one on, at the scale the overflows left
  // and with finite gradient norms.
  const auto steps = test::metrics_of_kind(out, "train");
  ASSERT_EQ(steps.size(), 40u);
  for (size_t i = skips.size(); i < steps.size(); ++i) {
    EXPECT_EQ(steps[i]["loss_scale"].get<double>(), scale) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(steps[i]["grad_norm"].get<double>())) << "step " << i + 1;
  }
}

// Killed after its step-8 checkpoint, with overflows behind it and a doubling ahead, the
// resumed run repeats the straight run's skips, losses and weights.
TEST_F(LossScalingRun, AResumedRunScalesAsOneThatNeverStopped) {
  const std::string scaling = "--set train.loss_scale=dynamic --set train.loss_scale_init=1.361129467683754e39 "
                              "--set train.loss_scale_growth_interval=5";
  const std::string straight = train("straight", scaling);
  const std::string out = train("killed", scaling, "kill_at_step:10", -SIGKILL);
  ASSERT_TRUE(std::filesystem::exists(test::checkpoint_path(out, 8)));
  std::string output;
  ASSERT_EQ(run_with_fault(tiny_train(corpus_, out, "--set optim.grad_clip=0.05 " + scaling + " --resume"), "",
                           &output),
            0)
      << output;
  EXPECT_EQ(test::train_records(out), test::train_records(straight));
  EXPECT_EQ(scales(out), scales(straight));
  EXPECT_EQ(test::metrics_of_kind(out, "skip").size(), test::metrics_of_kind(straight, "skip").size());
  EXPECT_EQ(model_bytes(out), model_bytes(straight));
}

TEST_F(LossScalingRun, AScaleThatIsNotAPowerOfTwoIsRefusedByKey) {
  std::string output;
  EXPECT_EQ(run_with_fault(tiny_train(corpus_, dir_ + "/bad", "--set train.loss_scale=dynamic "
                                                              "--set train.loss_scale_init=1000"),
                           "", &output),
            1);
  EXPECT_CONTAINS(output, "train.loss_scale_init (1000) must be a power of two >= 1");
}

}  // namespace
}  // namespace kiln
