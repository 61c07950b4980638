// Loss curves side by side as one self-contained SVG (no script, nothing fetched): `loom verify
// --numerics --plot`. Each series is a run's training loss per step (a line; non-finite steps leave a
// gap) and its validation losses (dots).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom::cli {

struct LossSeries {
  std::string name;
  std::vector<double> loss;                     // step k + 1 at index k
  std::vector<std::pair<int64_t, double>> val;  // (step, validation loss)
};

std::string loss_curves_svg(const std::string& title, const std::vector<LossSeries>& series);

}  // namespace loom::cli
