#include "loom/train/prepare.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "loom/core/file_writer.h"
#include "loom/core/philox.h"
#include "loom/error.h"
#include "loom/train/shard_format.h"
#include "loom/train/tokenizer.h"

namespace loom::train {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

bool ours(const std::string& name) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  auto ends = [&](const char* s) {
    return name.size() >= std::strlen(s) && name.compare(name.size() - std::strlen(s), std::string::npos, s) == 0;
  };
  return name == kShardSetManifest || name == "tokenizer.model" || ends(".tmp") ||
         ((starts("train-") || starts("validation-")) && ends(".bin"));
}

// Makes `dir` ready for a new shard set: refuses a folder holding anything
// prepare did not write (so `--out ~` cannot delete a home folder), then
// removes the manifest first -- a crash from here on leaves a folder the loader
// refuses as incomplete -- and the old shards.
void clear_out_dir(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError("cannot create output folder '" + dir.string() + "': " + ec.message());
  std::vector<fs::path> old;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!ours(name) || !e.is_regular_file())
      throw IoError("output folder '" + dir.string() + "' holds '" + name +
                    "', which `loom prepare` did not write: choose a new or empty --out folder");
    old.push_back(e.path());
  }
  fs::remove(dir / kShardSetManifest, ec);
  for (const auto& p : old) fs::remove(p, ec);
  fsync_directory(dir.string());
}

// Validation = the k documents whose Philox keys are smallest: exactly round(f
// n) documents, a pure function of (seed, document index), independent of the
// text, so a split is reproducible.
std::vector<int64_t> choose_validation(int64_t n, double fraction, uint64_t seed) {
  if (fraction <= 0) return {};
  if (n < 2)
    throw ConfigError("the corpus holds " + std::to_string(n) +
                      " document(s): a validation split needs at least 2; pass --val-fraction 0 or more text");
  const int64_t k = std::clamp<int64_t>(std::llround(fraction * static_cast<double>(n)), 1, n - 1);
  const uint64_t stream = stream_of("loom.data.split");
  std::vector<std::pair<uint32_t, int64_t>> keyed(static_cast<size_t>(n));
  for (int64_t d = 0; d < n; ++d)
    keyed[static_cast<size_t>(d)] = {Philox::u32(seed, stream, static_cast<uint64_t>(d)), d};
  std::nth_element(keyed.begin(), keyed.begin() + k, keyed.end());
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < k; ++i) ids.push_back(keyed[static_cast<size_t>(i)].second);
  std::sort(ids.begin(), ids.end());
  return ids;
}

// Accumulates one split's tokens and writes a shard whenever it reaches the
// size limit.
class SplitWriter {
 public:
  SplitWriter(const fs::path& dir, Split split, const Tokenizer& tok, int64_t shard_tokens, ShardSet& set)
      : dir_(dir), split_(split), tok_(tok), limit_(shard_tokens), set_(set) {}
  void add_document(const std::vector<int32_t>& ids) {
    buf_.insert(buf_.end(), ids.begin(), ids.end());
    buf_.push_back(tok_.eos_id());  // one end-of-document after every document
    ++docs_;
    if (static_cast<int64_t>(buf_.size()) >= limit_) flush();
  }
  void flush() {
    if (buf_.empty()) return;
    const std::string name = fmt::format("{}-{:05}.bin", split_ == Split::Train ? "train" : "validation", count_++);
    ShardHeader h;
    h.token_bytes = token_bytes_for(tok_.vocab_size());
    h.tokenizer_hash = tok_.hash();
    h.vocab_size = static_cast<uint32_t>(tok_.vocab_size());
    h.split = split_;
    h.documents = static_cast<uint64_t>(docs_);
    h = write_shard(dir_ / name, h, buf_);
    set_.shards.push_back({name, split_, static_cast<int64_t>(h.tokens), docs_, h.checksum});
    (split_ == Split::Train ? set_.train_tokens : set_.validation_tokens) += static_cast<int64_t>(h.tokens);
    buf_.clear();
    docs_ = 0;
  }

 private:
  fs::path dir_;
  Split split_;
  const Tokenizer& tok_;
  int64_t limit_;
  ShardSet& set_;
  std::vector<int32_t> buf_;
  int64_t docs_ = 0;
  int count_ = 0;
};

}  // namespace

PrepareResult prepare_corpus(const PrepareOptions& o, const std::function<void(const PrepareProgress&)>& on_progress) {
  const auto t0 = Clock::now();
  auto report = [&](const PrepareProgress& p) {
    if (on_progress) on_progress(p);
  };
  if (!(o.val_fraction >= 0 && o.val_fraction < 1))
    throw ConfigError(fmt::format("--val-fraction {} must be in [0, 1)", o.val_fraction));
  if (o.shard_tokens < 1) throw ConfigError("--shard-tokens must be positive");
  if (o.out_dir.empty()) throw ConfigError("--out is required: the folder to write the shards into");
  if (!o.overwrite && fs::exists(o.out_dir / kShardSetManifest))
    throw ConfigError("--out '" + o.out_dir.string() + "' already holds a prepared shard set (runs and checkpoints " +
                      "made from it need its tokenizer): pass --overwrite to replace it, or choose another --out " +
                      "(nothing was changed)");

  PrepareResult r;
  r.files = find_corpus_files(o.inputs);
  // An --out folder inside an input folder (e.g. `--input . --out data/x`) must not feed a
  // previous run's manifest back in as text.
  {
    std::error_code ec;
    const fs::path out = fs::weakly_canonical(o.out_dir, ec);
    std::erase_if(r.files.files, [&](const CorpusFile& f) {
      const fs::path p = fs::weakly_canonical(f.path, ec);
      const bool inside = p.parent_path() == out;
      if (inside) r.files.total_bytes -= f.bytes, r.files.skipped.push_back({f.path, "output"});
      return inside;
    });
    if (r.files.files.empty()) throw IoError("no text files found in the inputs outside the --out folder");
  }
  const uint64_t total = r.files.total_bytes;
  PrepareProgress p;
  p.bytes_total = total;
  report(p);
  p.files = &r.files;

  // Pass 1: count documents (the split needs their number before any is
  // written).
  int64_t n_docs = 0;
  for (const auto& f : r.files.files) {
    n_docs += static_cast<int64_t>(split_documents(read_file(f.path)).size());
    p.bytes_done += f.bytes;
    p.documents = n_docs;
    report(p);
  }
  if (n_docs == 0) throw ConfigError("the inputs hold no text (every document is empty)");
  const std::vector<int64_t> val_ids = choose_validation(n_docs, o.val_fraction, o.seed);

  // The tokenizer: given, or trained on every line of every document.
  const auto t_tok = Clock::now();
  std::optional<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    tok = Tokenizer::load(o.tokenizer);
  } else {
    p = PrepareProgress{PrepareProgress::Phase::TokenizerRead, 0, total, 0, 0, 0, &r.files};
    size_t file = 0, pos = 0;
    std::string text;
    bool loaded = false;
    auto next_line = [&](std::string& line) {
      while (true) {
        if (!loaded) {
          if (file >= r.files.files.size()) {
            p.phase = PrepareProgress::Phase::TokenizerTrain;
            report(p);
            return false;
          }
          text.clear();
          for (const auto& d : split_documents(read_file(r.files.files[file].path))) text += d + "\n";
          loaded = true;
          pos = 0;
        }
        if (pos >= text.size()) {
          p.bytes_done += r.files.files[file].bytes;
          report(p);
          ++file;
          loaded = false;
          continue;
        }
        const size_t nl = text.find('\n', pos);
        line.assign(text, pos, nl - pos);
        pos = nl + 1;
        return true;
      }
    };
    tok = Tokenizer::train(next_line, {o.vocab_size, o.threads, 2'000'000, o.seed});
  }
  r.tokenizer_seconds = since(t_tok);

  clear_out_dir(o.out_dir);
  ShardSet& set = r.set;
  tok->save(o.out_dir / set.tokenizer_file);
  set.tokenizer_hash = tok->hash();
  set.vocab_size = tok->vocab_size();
  set.eos_id = tok->eos_id();
  set.tokenizer_trained = o.tokenizer.empty();
  set.seed = o.seed;
  set.val_fraction = o.val_fraction;
  set.inputs = o.inputs;
  set.files = static_cast<int64_t>(r.files.files.size());
  set.validation_document_ids = val_ids;

  // Pass 2: encode each document into its split's shards.
  p = PrepareProgress{PrepareProgress::Phase::Encode, 0, total, 0, 0, 0, &r.files};
  report(p);
  SplitWriter train(o.out_dir, Split::Train, *tok, o.shard_tokens, set);
  SplitWriter validation(o.out_dir, Split::Validation, *tok, o.shard_tokens, set);
  int64_t doc = 0;
  size_t next_val = 0;
  // Documents are encoded in parallel a chunk at a time and appended in corpus order, so the
  // shards are byte-identical whatever the thread count (sentencepiece's Encode is const and
  // thread-safe). Chunks keep the progress display moving inside one large file.
  constexpr size_t kChunk = 1024;
  const int threads = std::max(1, o.threads);
  for (const auto& f : r.files.files) {
    const std::vector<std::string> docs = split_documents(read_file(f.path));
    std::vector<std::vector<int32_t>> ids(std::min(kChunk, docs.size()));
    for (size_t first = 0; first < docs.size(); first += kChunk) {
      const size_t n = std::min(kChunk, docs.size() - first);
      std::vector<std::string> errors(n);  // an exception must not leave an OpenMP region
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
      for (size_t i = 0; i < n; ++i) {
        try {
          ids[i] = tok->encode(docs[first + i]);
        } catch (const std::exception& e) {
          errors[i] = e.what();
        }
      }
      for (size_t i = 0; i < n; ++i)
        if (!errors[i].empty())
          throw IoError(fmt::format("'{}', document {}: {}", f.path.string(), first + i + 1, errors[i]));
      for (size_t i = 0; i < n; ++i) {
        const bool is_val = next_val < val_ids.size() && val_ids[next_val] == doc;
        if (is_val) ++next_val;
        p.tokens += static_cast<int64_t>(ids[i].size()) + 1;
        (is_val ? validation : train).add_document(ids[i]);
        ++(is_val ? set.validation_documents : set.train_documents);
        ++doc;
      }
      p.documents = doc;
      p.shards = static_cast<int64_t>(set.shards.size());
      report(p);
    }
    p.bytes_done += f.bytes;
    report(p);
  }
  train.flush();
  validation.flush();
  if (doc != n_docs)
    throw IoError(fmt::format(
        "the corpus changed while it was prepared ({} documents, then {}): run `loom prepare` again", n_docs, doc));
  fsync_directory(o.out_dir.string());
  write_shard_set(o.out_dir, set);

  p.phase = PrepareProgress::Phase::Done;
  p.shards = static_cast<int64_t>(set.shards.size());
  report(p);
  r.seconds = since(t0);
  return r;
}

}  // namespace loom::train
