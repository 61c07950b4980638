#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>

#include "loom/core/safetensors.h"
#include "loom/error.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {
fs::path temp(const std::string& name) { return fs::temp_directory_path() / (name + "-" + std::to_string(::getpid())); }

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void write_all(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }
}  // namespace

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  std::mt19937 rng(5);
  std::vector<float> a(12);
  for (auto& x : a) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  std::vector<int64_t> b = {1, -2, 3};
  auto path = temp("st-roundtrip");
  write_safetensors(path.string(), {{"b", DType::I64, {3}, b.data(), 24}, {"a.weight", DType::F32, {3, 4}, a.data(), 48}},
                    {{"format", "pt"}});
  SafetensorsFile f(path.string());
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "a.weight");  // sorted by name
  EXPECT_EQ(f.at("a.weight").shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(0, std::memcmp(f.at("a.weight").data, a.data(), 48));
  EXPECT_EQ(0, std::memcmp(f.at("b").data, b.data(), 24));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  // The data section starts 8-byte aligned, as the format recommends.
  std::string bytes = read_all(path);
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  EXPECT_EQ(len % 8, 0u);
  fs::remove(path);
}

TEST(Safetensors, TruncatedFileIsRefusedNamingTheTensor) {
  std::vector<float> a(256, 1.0f);
  auto path = temp("st-trunc");
  write_safetensors(path.string(), {{"big", DType::F32, {256}, a.data(), 1024}});
  std::string bytes = read_all(path);
  write_all(path, bytes.substr(0, bytes.size() - 100));
  try {
    SafetensorsFile f(path.string());
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("'big'"), std::string::npos) << e.what();
  }
  fs::remove(path);
}

TEST(Safetensors, MalformedHeadersAreRefused) {
  auto path = temp("st-bad");
  auto with_header = [&](const std::string& h, size_t data = 0) {
    std::string s(8, '\0');
    uint64_t len = h.size();
    std::memcpy(s.data(), &len, 8);
    write_all(path, s + h + std::string(data, '\0'));
  };
  with_header("{not json");
  EXPECT_THROW(SafetensorsFile(path.string()), IoError);
  with_header(R"({"x": {"dtype": "F16", "shape": [1], "data_offsets": [0, 2]}})", 2);
  EXPECT_THROW(SafetensorsFile(path.string()), IoError);  // unsupported dtype
  with_header(R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 4);
  EXPECT_THROW(SafetensorsFile(path.string()), IoError);  // size disagrees with shape
  with_header(R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8);
  EXPECT_THROW(SafetensorsFile(path.string()), IoError);  // reversed offsets
  write_all(path, std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8));
  EXPECT_THROW(SafetensorsFile(path.string()), IoError);  // header length beyond the file
  write_all(path, "abc");
  EXPECT_THROW(SafetensorsFile(path.string()), IoError);
  fs::remove(path);
}

// Found by fuzz/safetensors_fuzz.cpp: the element count of a shape was multiplied in int64 without an
// overflow check, so [2^62, 4] F32 wrapped to 0 bytes and passed as a tensor with no data.
TEST(Safetensors, ShapeWhoseSizeOverflowsIsRefused) {
  auto bytes = [](const std::string& h) {
    std::vector<char> b(8);
    const uint64_t len = h.size();
    std::memcpy(b.data(), &len, 8);
    b.insert(b.end(), h.begin(), h.end());
    return b;
  };
  for (const char* shape : {"[4611686018427387904, 4]", "[4294967296, 4294967296]", "[9223372036854775807, 3]"}) {
    const std::string h = std::string(R"({"w": {"dtype": "F32", "shape": )") + shape + R"(, "data_offsets": [0, 0]}})";
    try {
      SafetensorsFile f(bytes(h), "hostile.safetensors");
      FAIL() << shape << " was accepted";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("hostile.safetensors: tensor 'w'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("overflows"), std::string::npos) << e.what();
    }
  }
  // A zero-sized dimension still makes an empty tensor, however large the others.
  SafetensorsFile empty(bytes(R"({"w": {"dtype": "F32", "shape": [0, 4611686018427387904], "data_offsets": [0, 0]}})"),
                        "empty.safetensors");
  EXPECT_EQ(empty.at("w").nbytes, 0u);
}
