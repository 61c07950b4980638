// Sharded checkpoints cut into pieces: which elements of which tensor a rank writes, where each piece's
// elements sit in the whole tensor, and how any rank of any layout finds its own elements again among the
// pieces of another. Pure arithmetic over parameter tables, so the writer, the loader, `loom ckpt` and the
// tests all derive the same answer.
//
// Why elements and not rectangular slices: a tensor-parallel shard is not always a box of the whole tensor
// (GPT-2's fused c_attn is split per q, k and v; a vocabulary tp does not divide is padded), but it is
// always a set of runs of consecutive global elements, and a row-parallel shard's runs repeat at a fixed
// stride, which PieceRun writes once.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/spec/param_table.h"

namespace loom::train {

// `count` blocks of `length` consecutive elements of the whole (row-major) tensor, the i-th starting at
// global + i * stride; a piece's data holds its runs' blocks one after another.
struct PieceRun {
  int64_t global = 0, length = 0, stride = 0, count = 1;
  int64_t numel() const { return length * count; }
  bool operator==(const PieceRun&) const = default;
};
int64_t runs_numel(const std::vector<PieceRun>& runs);

// One piece a rank saves: arena elements [begin, end) of its table, all in parameter `param` (its index
// in the table), none of them padding, laid over the whole tensor as `runs`.
struct SavePiece {
  size_t param = 0;
  int64_t begin = 0, end = 0;
  std::vector<PieceRun> runs;
};

// The pieces of `owned` (ascending, disjoint arena ranges of `table`): cut at parameter boundaries and
// around padding, each with its runs compressed.
std::vector<SavePiece> save_pieces(const spec::ParamTable& table, const std::vector<spec::ArenaRange>& owned);

// The arena ranges a rank writes so that the ranks of a job write every element exactly once: of the
// elements it holds, those it is the first tensor-parallel holder of (a replicated norm is written by tp
// rank 0, a KV head shared by several ranks by the first), and of those its data-parallel share -- its
// ZeRO pieces (`optimizer_pieces`, non-empty under ZeRO), else the same split of the units among the
// replicas, so every replica writes 1/dp of the state instead of rank 0 all of it.
// Under expert parallelism over `ep` of the dp ranks, the routed experts' weights (which each ep group
// holds one copy of) are written by the first ep group, every rank its own experts; under ZeRO by the
// rank owning each piece, like everything else.
std::vector<spec::ArenaRange> saved_ranges(const spec::ParamTable& table, int64_t n_layers, int dp, int dp_rank,
                                           const std::vector<spec::ArenaRange>& optimizer_pieces, int ep = 1);

// Where the elements of one tensor (weights or one AdamW moment) sit among a checkpoint's pieces.
class PieceIndex {
 public:
  struct Source {
    size_t entry = 0;     // the caller's id of the piece (its manifest entry)
    int64_t offset = 0;   // element of the piece's data holding `global`
  };
  // Registers piece `entry` of the tensor `key` (parameter name + role) with `runs`.
  void add(const std::string& key, size_t entry, const std::vector<PieceRun>& runs);
  bool contains(const std::string& key) const { return runs_.count(key) != 0; }
  // Calls f(source, n) for the pieces holding global elements [global, global + n) of `key`, in order; the
  // first global element no piece holds is returned (global + n when all are held).
  int64_t find(const std::string& key, int64_t global, int64_t n,
               const std::function<void(const Source&, int64_t)>& f) const;
  // The first element of [0, numel) no piece holds, or numel.
  int64_t first_gap(const std::string& key, int64_t numel) const;

 private:
  struct Run {
    int64_t global, length;
    Source source;
  };
  // Sorted by global once everything is added (sort on first use).
  mutable std::unordered_map<std::string, std::vector<Run>> runs_;
  mutable bool sorted_ = true;
  void sort() const;
};

}  // namespace loom::train
