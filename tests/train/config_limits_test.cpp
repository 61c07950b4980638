// Every numeric config key has a declared range, enforced the same way for TOML, --set and the CLI
// flags that stand for keys; sizes derived from user input are computed with checked arithmetic, so a
// hostile or careless config is a one-line ConfigError before anything is allocated.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fmt/format.h>

#include "loom/error.h"
#include "loom/spec/param_table.h"
#include "loom/train/run_config.h"

namespace {

using loom::ConfigError;
using loom::train::parse_run_config;

// The error a config with these overrides is refused with ("" if it is accepted).
std::string refusal(const std::vector<std::string>& sets, const std::string& toml = "") {
  try {
    parse_run_config(toml, "test.toml", sets);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string literal(double v, const std::string& type) {
  if (type == "integer") return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{:.17g}", v);
}

TEST(ConfigLimits, EveryNumericKeyRefusesValuesOutsideItsRangeNamingTheKey) {
  int numeric = 0;
  for (const auto& k : loom::train::config_keys()) {
    if (!k.numeric) continue;
    ++numeric;
    SCOPED_TRACE(k.key);
    EXPECT_LT(k.lo, k.hi);
    // Just below the lowest value and just above the highest, in the key's own type.
    const double step = k.type == "integer" ? 1 : std::max(1e-9, std::abs(k.lo) * 1e-6);
    const double below = k.lo_open ? k.lo : k.lo - step;
    std::string e = refusal({k.key + "=" + literal(below, k.type)});
    EXPECT_NE(e.find(k.key), std::string::npos) << e;
    EXPECT_NE(e.find("out of range"), std::string::npos) << e;
    if (k.hi < 9e18) {  // the seed's top is int64's
      const double above = k.hi_open ? k.hi : k.hi + std::max(1.0, k.hi * 1e-6);
      e = refusal({k.key + "=" + literal(above, k.type)});
      EXPECT_NE(e.find(k.key), std::string::npos) << e;
    }
    if (k.type == "number") {
      for (const char* bad : {"inf", "-inf", "nan"}) {
        e = refusal({k.key + "=" + bad});
        EXPECT_NE(e.find(k.key), std::string::npos) << bad << ": " << e;
      }
      // The same rule holds for a TOML file.
      const auto dot = k.key.find('.');
      const std::string toml = dot == std::string::npos ? k.key + " = nan\n"
                                                        : "[" + k.key.substr(0, dot) + "]\n" + k.key.substr(dot + 1) + " = nan\n";
      e = refusal({}, toml);
      EXPECT_NE(e.find(k.key), std::string::npos) << e;
    }
  }
  EXPECT_GE(numeric, 30);  // the registry's numeric keys, all covered
}

TEST(ConfigLimits, HelpShowsEachNumericKeysRange) {
  const std::string help = loom::train::config_reference();
  EXPECT_NE(help.find("train.seq_len              integer  tokens per sequence (0: model.max_seq) [0, 2^24]"),
            std::string::npos)
      << help;
  EXPECT_NE(help.find("train.lr                   number   peak learning rate (0, 100]"), std::string::npos) << help;
  EXPECT_NE(help.find("train.beta2                number   AdamW beta2 [0, 1)"), std::string::npos) << help;
}

TEST(ConfigLimits, TheIssuesExamplesAreRefusedNamingTheKey) {
  EXPECT_NE(refusal({"train.seq_len=-1"}).find("train.seq_len = -1 is out of range"), std::string::npos);
  EXPECT_NE(refusal({"train.lr=inf"}).find("train.lr = inf is out of range"), std::string::npos);
  EXPECT_NE(refusal({"model.d_model=759249034", "model.n_heads=1", "model.n_kv_heads=1", "model.vocab_size=1000",
                     "train.seq_len=1"})
                .find("model.d_model = 759249034"),
            std::string::npos);
  EXPECT_NE(refusal({"model.n_layers=100000000"}).find("model.n_layers"), std::string::npos);
}

TEST(ConfigLimits, SizesThatOverflowInsideTheRangesNameTheKeysTheyCameFrom) {
  // Every key within its range, the parameter count past 2^64.
  std::string e = refusal({"model.n_layers=65536", "model.d_model=16777216", "model.n_heads=1", "model.n_kv_heads=1",
                           "model.d_ff=16777216"});
  EXPECT_NE(e.find("does not fit in 64 bits"), std::string::npos) << e;
  EXPECT_NE(e.find("model.n_layers = 65536"), std::string::npos) << e;
  EXPECT_NE(e.find("model.d_model = 16777216"), std::string::npos) << e;
  // Past the parameter limit without overflowing: the count and its sources are named.
  e = refusal({"model.d_model=1048576", "model.n_heads=1", "model.n_kv_heads=1"});
  EXPECT_NE(e.find("parameter count"), std::string::npos) << e;
  EXPECT_NE(e.find("model.d_model = 1048576"), std::string::npos) << e;
  // The logits of one micro-batch: micro x T x V x 4 bytes.
  e = refusal({"model.max_seq=16777216", "train.batch_size=16777216", "model.vocab_size=2000000", "train.steps=1"});
  EXPECT_NE(e.find("train.micro_batch_size = 16777216"), std::string::npos) << e;
  EXPECT_NE(e.find("model.vocab_size = 2000000"), std::string::npos) << e;
  // Token offsets of the data order: steps x batch x T.
  e = refusal({"train.steps=1099511627776", "train.batch_size=16777216", "train.micro_batch_size=1",
               "model.max_seq=4096"});
  EXPECT_NE(e.find("train.steps"), std::string::npos) << e;
}

TEST(ConfigLimits, ABatchSmallerThanTheDataParallelDegreeIsRefusedNotDividedByZero) {
  // Found by fuzz/run_config_fuzz: micro_batch_size = 0 means batch / dp, which was 0 here.
  const std::string e = refusal({"train.batch_size=2", "parallel.dp=4"});
  EXPECT_NE(e.find("train.batch_size = 2 is smaller than parallel.dp = 4"), std::string::npos) << e;
}

TEST(ConfigLimits, CheckedParameterCountIsTheParameterTablesCount) {
  for (const auto& name : loom::spec::preset_names()) {
    for (bool tied : {true, false}) {
      auto c = loom::spec::preset(name);
      c.tie_embeddings = tied;
      const auto table = loom::spec::build_param_table(c);
      int64_t sum = 0;
      for (const auto& p : table.params()) sum += p.numel();
      EXPECT_EQ(loom::spec::checked_parameter_count(c).value(), sum) << name << " tied=" << tied;
    }
  }
}

TEST(ConfigLimits, ValidationAndTheParameterTableAreLinearInTheModelSize) {
  // 65536 blocks: the largest n_layers accepted. A quadratic duplicate check took hours here.
  const auto t0 = std::chrono::steady_clock::now();
  auto cfg = parse_run_config("", "test", {"model.n_layers=65536", "model.d_model=16", "model.n_heads=1",
                                          "model.n_kv_heads=1", "model.d_ff=16", "model.vocab_size=64"});
  const auto table = loom::spec::build_param_table(cfg.model.resolved);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(table.params().size(), 65536u * 12 + 4);
  EXPECT_LT(s, 5.0);
  EXPECT_EQ(table.index_of("transformer.h.65535.mlp.c_proj.bias").value(), table.params().size() - 3);
}

}  // namespace
