// Before any work, every rank of a job must be running the same thing: the same build, resolved config,
// model (its parameter table), data and layout. Ranks started with different settings would otherwise
// train to the end and exit 0 with silently diverged replicas (or wedge in a collective of another
// size). Compared across the world at job start; a difference stops the job before step 1 with one line
// naming the keys and which ranks hold which value.
#pragma once

#include <string>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/spec/param_table.h"
#include "loom/train/run_config.h"
#include "loom/train/token_source.h"

namespace loom::train {

// One thing every rank must agree on: a name (a config key, "model.parameter_table", ...) and its value
// as text.
struct RankFact {
  std::string key, value;
};

// What a run is, before its data is opened: build, every config key that changes the computation (not
// where this rank writes its files), the parameter table (names, shapes, offsets, placements), the
// world size.
std::vector<RankFact> run_facts(const RunConfig& cfg, const spec::ParamTable& table, int world_size,
                                const std::string& build);
// What the data is (the tokenizer and shard set, by content).
std::vector<RankFact> data_facts(const TokenSource& data);

// Collective over `group`: returns when every rank holds the same facts, else throws ConfigError
// naming each fact that differs and the ranks that hold each value. `what` names the stage ("the run",
// "the data"). Costs one all-gather of 16 bytes when the ranks agree.
void check_ranks_agree(comm::ProcessGroup& group, const std::vector<RankFact>& facts, const std::string& what);

}  // namespace loom::train
