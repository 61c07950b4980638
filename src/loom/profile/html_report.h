// `loom profile report --html OUT.html`: the step report as one self-contained page (no script, no
// network): the verdict and opportunities, a timeline of one step across ranks (inline SVG, a compute and
// a communication lane per rank), the step's breakdown per rank as stacked bars, the roofline with every
// kernel class on it, and the text report.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "loom/profile/step_report.h"
#include "loom/profile/trace_reader.h"

namespace loom::profile {

// spans: the trace the report came from (the timeline shows rank 0's last analysed step and what every
// rank ran in that window); title names the run.
// `sections`: further (heading, preformatted text) blocks the caller adds after the text report (the
// planner's prediction beside the measurement).
std::string html_report(const StepReport& report, const std::vector<TraceSpan>& spans, const std::string& title,
                        const std::vector<std::pair<std::string, std::string>>& sections = {});

}  // namespace loom::profile
