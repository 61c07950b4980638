// Reading a run's metrics.jsonl in the CLI tests, and comparing loss curves.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace loom::test {

// The training loss of every step the run logged in `dir`/metrics.jsonl (NaN where it was not finite:
// the log writes null).
inline std::vector<double> losses(const std::filesystem::path& dir) {
  std::vector<double> out;
  std::ifstream f(dir / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    out.push_back(j["loss"].is_number() ? j["loss"].get<double>() : std::nan(""));
  }
  return out;
}

// Largest relative difference between two curves of the same length.
inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(std::abs(a[i]), 1e-12));
  return worst;
}

// How many times `what` occurs in `text` (e.g. PASS lines in `loom verify`'s report).
inline int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace loom::test
