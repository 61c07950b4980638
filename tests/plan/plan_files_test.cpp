// The planner's input files refuse hostile values with a ConfigError naming the file, and what
// hardware_to_toml writes parses back (fuzz/hardware_fuzz.cpp and fuzz/validation_fuzz.cpp found the
// cases pinned here).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>

#include "../test_support.h"
#include "loom/error.h"
#include "loom/plan/hardware.h"
#include "loom/plan/validation.h"

using namespace loom;
using namespace loom::plan;

namespace {

const std::vector<std::string> kDirs = {LOOM_SOURCE_DIR "/configs/hardware"};

const std::string kHardware =
    "[device]\npeak_tflops = { bf16 = 100 }\nmemory_GiB = 80\nmemory_bandwidth_GBps = 2000\n[node]\ndevices = 8\n"
    "[intra_node]\nbandwidth_GBps = 300\nlatency_us = 2\n[inter_node]\nbandwidth_GBps = 25\nlatency_us = 5\n";

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

// A row of published_results.toml with some keys set to other values (a value "" drops the key).
std::string row(const std::vector<std::pair<std::string, std::string>>& changes = {}) {
  std::vector<std::pair<std::string, std::string>> keys = {{"name", "\"r\""},
                                                           {"model", "\"gpt3-175b\""},
                                                           {"hardware", "\"a100\""},
                                                           {"devices", "64"},
                                                           {"seq", "2048"},
                                                           {"global_batch", "512"},
                                                           {"tp", "8"},
                                                           {"pp", "2"}};
  for (const auto& [k, v] : changes) {
    auto it = std::find_if(keys.begin(), keys.end(), [&](auto& kv) { return kv.first == k; });
    if (it == keys.end())
      keys.emplace_back(k, v);
    else
      it->second = v;
  }
  std::string text = "[[row]]\n";
  for (const auto& [k, v] : keys)
    if (!v.empty()) text += k + " = " + v + "\n";
  return text;
}

}  // namespace

// Found by the fuzzer: a name with a control character (or a quote) was written unescaped, so what
// `loom calibrate` writes could not be read back -- or read back as other keys.
TEST(HardwareFile, NamesWithQuotesAndControlCharactersRoundTrip) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("LOOM_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::string name = "\na\"b\\c\nd\re\tf";  // a leading newline too: a multi-line string would drop it
  for (int i = 0; i < 16; ++i) name.push_back(static_cast<char>(1 + rng() % 127));  // ASCII, controls included
  Hardware hw = parse_hardware(kHardware, "h.toml");
  hw.name = hw.source = hw.device.name = name;
  Hardware back = parse_hardware(hardware_to_toml(hw, "round trip"), "back.toml");
  EXPECT_EQ(back.name, name);
  EXPECT_EQ(back.source, name);
  EXPECT_EQ(back.device.name, name);
}

TEST(HardwareFile, FiguresThatAreNotFiniteOrTooLargeAreRefused) {
  for (const char* v : {"inf", "nan", "-1", "1e300"}) {
    std::string text = kHardware;
    text.replace(text.find("memory_GiB = 80"), 15, std::string("memory_GiB = ") + v);
    std::string e = error_of([&] { parse_hardware(text, "h.toml"); });
    EXPECT_NE(e.find("h.toml: 'device.memory_GiB'"), std::string::npos) << v << ": " << e;
  }
  // Checked before the cast to int (1e300 would be undefined behaviour).
  for (const char* v : {"1e300", "2.5", "0", "2000000"}) {
    std::string text = kHardware;
    text.replace(text.find("devices = 8"), 11, std::string("devices = ") + v);
    EXPECT_NE(error_of([&] { parse_hardware(text, "h.toml"); }).find("h.toml"), std::string::npos) << v;
  }
  // The compute slowdown under overlapped collectives is a fraction; 0 (the default) makes overlap free.
  EXPECT_EQ(parse_hardware(kHardware, "h.toml").efficiency.overlap_slowdown, 0);
  EXPECT_EQ(parse_hardware(kHardware + "[efficiency]\noverlap_slowdown = 0.25\n", "h.toml").efficiency.overlap_slowdown,
            0.25);
  for (const char* v : {"-0.1", "1.5", "nan"}) {
    const std::string text = kHardware + "[efficiency]\noverlap_slowdown = " + v + "\n";
    const std::string e = error_of([&] { parse_hardware(text, "h.toml"); });
    EXPECT_NE(e.find("h.toml: 'efficiency.overlap_slowdown'"), std::string::npos) << v << ": " << e;
  }
}

TEST(ValidationFile, PublishedResultsParseRowByRow) {
  auto rows = parse_validation(row({{"tflops_96", "140"}, {"vpp", "3"}, {"micro_batch", "1"}}), "v.toml", kDirs);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].fixed.dp, 4);
  EXPECT_EQ(rows[0].fixed.vpp, 3);
  EXPECT_EQ(rows[0].tflops_96, 140);
  EXPECT_FALSE(rows[0].mfu);
  EXPECT_EQ(rows[0].job.cluster.devices, 64);
}

// The old reader divided by tp * pp (0: SIGFPE) and cast doubles to int (1e300: undefined behaviour),
// and an unknown model's error did not say which file or row.
TEST(ValidationFile, BadRowsAreRefusedNamingTheFileRowAndKey) {
  auto refused = [](const std::string& text, const std::string& why) {
    std::string e = error_of([&] { parse_validation(text, "v.toml", kDirs); });
    EXPECT_NE(e.find("v.toml"), std::string::npos) << e;
    EXPECT_NE(e.find(why), std::string::npos) << e;
  };
  refused(row({{"tp", "0"}}), "'tp'");
  refused(row({{"devices", "1e300"}}), "'devices'");
  refused(row({{"seq", "20000000000"}}), "'seq'");
  refused(row({{"global_batch", ""}}), "'global_batch' is missing");
  refused(row({{"pp", "3"}}), "does not divide devices");
  refused(row({{"model", "\"gpt-5\""}}), "validation row 'r': unknown model");
  refused(row({{"hardware", "\"tpu\""}}), "validation row 'r': unknown cluster");
  refused(row({{"mfu", "-0.5"}}), "'mfu'");
  refused(row({{"software", "\"megatron\""}, {"ddp", "\"fsdp\""}}), "'ddp'");
  refused("x = 1\n", "no [[row]] entries");
}
