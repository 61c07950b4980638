#include "loom/train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>

#include "loom/core/checksum.h"
#include "loom/error.h"
#include "loom/kernels/elementwise.h"

namespace loom::train {

namespace {
// Point-to-point tags of a checkpoint's tensor-parallel shard gather (three per rank: master, m, v), and
// of the tied embedding's gradient exchange between the first and the last pipeline stage, clear of any
// other sender's.
constexpr uint64_t kTpShardTag = uint64_t{0x5A5} << 40;
constexpr uint64_t kTiedEmbeddingTag = uint64_t{0x5B1} << 40;
}  // namespace

Trainer::Trainer(const RunConfig& cfg, kernels::Backend& backend, double peak_flops, const parallel::Parallelism* par)
    : cfg_(cfg),
      backend_(backend),
      own_par_(par ? parallel::Parallelism{} : parallel::parallelize(nullptr, backend)),
      par_(par ? *par : own_par_),
      dp_(par_.dp && par_.dp->size() > 1 ? par_.dp : nullptr),
      tp_(par_.tp && par_.tp->size() > 1 ? par_.tp : nullptr),
      pp_(par_.pp && par_.pp->size() > 1 ? par_.pp : nullptr),
      dp_size_(dp_ ? dp_->size() : 1),
      dp_rank_(dp_ ? dp_->rank() : 0),
      cp_(par_.cp_size()),
      cp_rank_(par_.cp_rank()),
      data_ranks_(dp_size_ / cp_),
      data_rank_(dp_rank_ / cp_),
      peak_flops_(peak_flops),
      flops_per_token_(spec::model_flops_per_token(cfg.model.resolved, cfg.seq_len())),
      schedule_{cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, cfg.train.steps},
      data_(make_token_source(cfg)) {
  cfg_.validate();
  if (cp_ != cfg_.parallel.cp)
    throw ConfigError("parallel.cp = " + std::to_string(cfg_.parallel.cp) + " but the context-parallel group has " +
                      std::to_string(cp_) + " rank(s)");
  if (dp_size_ != cfg_.parallel.dp * cfg_.parallel.cp)
    throw ConfigError("parallel.dp = " + std::to_string(cfg_.parallel.dp) + " but the data-parallel group has " +
                      std::to_string(dp_size_ / cp_) + " rank(s): start parallel.dp ranks (loom run -n " +
                      std::to_string(cfg_.parallel.dp) + " -- loom train ...)");
  // (validate() refused a sequence the cp chunks do not split.)
  if (cp_ > 1) cp_positions_ = spec::context_positions(cfg_.seq_len(), cp_, cp_rank_);
  if (par_.shard.tp_size != cfg_.parallel.tp)
    throw ConfigError("parallel.tp = " + std::to_string(cfg_.parallel.tp) + " but the tensor-parallel group has " +
                      std::to_string(par_.shard.tp_size) + " rank(s)");
  Allocator& alloc = backend_.allocator();
  const int64_t L = cfg_.model.resolved.n_layers;
  auto table = spec::build_param_table(cfg_.model.resolved, par_.shard);
  const bool lowp_mode = cfg_.precision == model::Precision::BF16;
  // The data-parallel strategy decides how the arenas are backed before they exist.
  const parallel::DataParallelSetup setup{&table, L, lowp_mode, cfg_.pure_bf16, static_cast<int>(cfg_.parallel.zero),
                                          static_cast<size_t>(cfg_.parallel.bucket_kb) << 10,
                                          cfg_.parallel.zero_release == "eager" ? PageReservation::Release::Eager
                                                                                : PageReservation::Release::Lazy};
  data_parallel_ = par_.data_parallel(setup, alloc, backend_.tracer());
  parallel::ArenaNeeds needs = data_parallel_->arena_needs();
  registered_grads_ = std::move(needs.grads_memory);
  model::ArenaBacking backing{needs.master_on_demand, needs.lowp_on_demand, needs.grads_on_demand,
                              registered_grads_.size() ? registered_grads_.as<float>() : nullptr};
  params_ = std::make_unique<model::ParameterStore>(
      std::move(table), cfg_.precision, alloc, backing,
      cfg_.pure_bf16 ? model::WeightStorage::Bf16Only : model::WeightStorage::F32Masters);
  if (cfg_.stochastic_rounding) params_->use_stochastic_rounding(cfg_.train.seed);
  params_->initialize(cfg_.train.seed, data_parallel_->weights_held());
  model_ = std::make_unique<model::Transformer>(cfg_.model.resolved, *params_, backend_, par_.ops.get(),
                                                 cfg_.train.recompute, par_.attention.get(), par_.experts.get());
  if (cfg_.fp8) {
    const auto& o = cfg_.fp8_options;
    fp8_ = std::make_unique<model::Fp8Recipe>(
        model::Fp8Config{model::parse_fp8_scaling(o.recipe), o.amax_history,
                         o.grad_format == "e4m3" ? Fp8Format::E4M3 : Fp8Format::E5M2, o.margin, 128},
        L, alloc);
    model_->set_fp8(fp8_.get());
  }
  optimizer_ = std::make_unique<AdamW>(
      *params_, AdamWConfig{cfg_.train.beta1, cfg_.train.beta2, cfg_.train.eps, cfg_.train.weight_decay}, alloc,
      data_parallel_->optimizer_pieces());
  if (pp_) check_pipeline_messages_fit();
  if (pp_)
    pipeline_ = std::make_unique<PipelineExecutor>(
        *model_, backend_, *pp_, par_.stages, spec::parse_schedule(cfg_.parallel.pipeline_schedule), cfg_.micro_batch(),
        local_seq_len(), lowp_mode && cfg_.parallel.pipeline_bf16_transfers, backend_.tracer());
  else
    ctx_ = model_->make_context(cfg_.micro_batch(), local_seq_len());
  data_parallel_->attach({params_->master().defined() ? params_->master().data<float>() : nullptr,
                          params_->lowp().defined() ? params_->lowp().data<bf16>() : nullptr,
                          params_->grads().data<float>(), params_->master_pages(), params_->lowp_pages(),
                          params_->grad_pages()});
  hooks_ = std::make_unique<StepHooks>(*data_parallel_);
  model_->set_hooks(hooks_.get());
  tokens_ = Tensor::empty({cfg_.micro_batch(), local_seq_len()}, DType::I32, alloc, MemCategory::Activations);
  targets_ = Tensor::empty({cfg_.micro_batch(), local_seq_len()}, DType::I32, alloc, MemCategory::Activations);
  if (cp_ > 1) {
    whole_tokens_ = Tensor::empty({cfg_.micro_batch(), cfg_.seq_len()}, DType::I32, alloc, MemCategory::Activations);
    whole_targets_ = Tensor::empty({cfg_.micro_batch(), cfg_.seq_len()}, DType::I32, alloc, MemCategory::Activations);
  }
}

StepMetrics Trainer::train_step(int64_t step) {
  profile::Tracer* tracer = backend_.tracer();
  profile::Span step_span(tracer, "step", profile::Category::Step);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t mb = cfg_.micro_batch(), T = cfg_.seq_len();
  // Data order is a function of the global sample index: dp rank r runs the r-th share of the batch
  // (its cp ranks each their tokens of those samples).
  const int64_t share = cfg_.train.batch_size / data_ranks_;
  const int64_t n_micro = share / mb;
  const int64_t first = (step - 1) * cfg_.train.batch_size + data_rank_ * share;
  // Every sample holds T targets (no padding), so the loss is the mean over batch * T of them.
  const float grad_scale = 1.0f / static_cast<float>(cfg_.train.batch_size * T);
  parallel::DataParallel& dp = *data_parallel_;
  {
    profile::Span zeroing(tracer, "zero_grads", profile::Category::Kernel);
    const kernels::KernelCost c = kernels::fill_zero_cost(dp.begin_step());
    zeroing.set_cost(c.flops, c.bytes);
  }
  double loss_sum = 0;
  std::vector<double> pipeline_idle;
  const double comm_cpu0 = dp.comm_cpu_seconds();
  const double tp_cpu0 = tp_ ? tp_->stats().comm_cpu_seconds : 0;
  const double cp_cpu0 = par_.cp ? par_.cp->stats().comm_cpu_seconds : 0;
  const double dp_wait0 = dp.wait_seconds();
  const double tp_wait0 = par_.tp_wait_seconds();
  const double cp_wait0 = par_.cp_wait_seconds();
  if (pipeline_) {
    // The schedule interleaves the micro-batches' passes; the data-parallel reduction waits for all of
    // them (no reduction under backward), then goes at once.
    dp.begin_micro_batch(true, false);
    const double pp_wait0 = pipeline_->wait_seconds();
    const auto pp_t0 = std::chrono::steady_clock::now();
    loss_sum = pipeline_->train(static_cast<int>(n_micro), tokens_, targets_,
                                [&](int64_t m) { load(first + m * mb, Split::Train); },
                                grad_scale);
    const double schedule_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - pp_t0).count();
    double idle = schedule_s > 0 ? (pipeline_->wait_seconds() - pp_wait0) / schedule_s : 0.0;
    pipeline_idle.assign(static_cast<size_t>(pp_->size()), 0.0);
    comm::issue_and_wait(tracer, "pp_idle_gather", 8, [&] {
      return pp_->all_gather(&idle, pipeline_idle.data(), 1, DType::F64);
    });
    sum_tied_embedding_grads();
    loss_sum = pp_sum(loss_sum);
    // Every gradient is final: each unit's reduction goes out, the head's first as in one backward.
    dp.begin_micro_batch(true, true);
    for (int64_t unit = cfg_.model.resolved.n_layers; unit >= -1; --unit) dp.after_backward(unit);
  }
  for (int64_t m = 0; !pipeline_ && m < n_micro; ++m) {
    profile::ScopedSpanContext where(profile::SpanContext::kNoUnit, nullptr, static_cast<int>(m));
    load(first + m * mb, Split::Train);
    // Gradients are scaled by the global sample count, so the sum over replicas is the batch gradient;
    // the strategy decides in which micro-batches it reduces.
    dp.begin_micro_batch(true, m == n_micro - 1);
    // A non-finite loss is judged after the step's losses are summed over the ranks (every rank the
    // same): its backward runs, and the step is then not applied.
    loss_sum += model_->forward(ctx_, tokens_, targets_, grad_scale);
    model_->backward(ctx_);
  }
  dp.finish_gradients();
  inject_non_finite_gradient(step);
  loss_sum = dp_sum(loss_sum);
  double norm = gradient_norm();
  // Replicated gradients (DDP): each replica took the norm of its own copy. A copy gone bad after the
  // reduction would make the replicas judge differently; one more scalar sum makes them agree.
  if (dp_ && !data_parallel_->gradients_sharded() && dp_sum(std::isfinite(norm) ? 0.0 : 1.0) > 0)
    norm = std::numeric_limits<double>::quiet_NaN();
  const double lr = schedule_.at(step);
  // Each replica's micro-batch losses are means over its tokens, all replicas holding equally many.
  const double mean_loss = loss_sum / static_cast<double>(n_micro * dp_size_);
  // A bad step is not applied (no update; the gradients are cleared at the next step's start). The
  // step still counts: its data is consumed and the schedule moves on.
  std::string skip_reason;
  switch (guard_.judge(mean_loss, norm)) {
    case BadStepGuard::Verdict::Apply: break;
    case BadStepGuard::Verdict::NonFiniteLoss: skip_reason = fmt::format("the loss is {}", mean_loss); break;
    case BadStepGuard::Verdict::NonFiniteGradient: skip_reason = non_finite_gradient(); break;
    case BadStepGuard::Verdict::LossSpike: skip_reason = guard_.spike_detail(mean_loss); break;
  }
  if (skip_reason.empty()) {
    const double clip = cfg_.train.grad_clip > 0 && norm > cfg_.train.grad_clip ? cfg_.train.grad_clip / norm : 1.0;
    optimizer_->step(lr, clip, tracer);
    if (dp.after_optimizer_step()) params_->refresh_lowp();
    guard_.applied(mean_loss);
  } else {
    guard_.skipped(step, skip_reason);  // throws past train.max_consecutive_skips
  }
  StepMetrics s;
  end_fp8_step(s);
  end_moe_step(s, skip_reason.empty());
  // Seconds this thread waited on dp, tp and cp collectives (communication nothing overlapped).
  const double exposed =
      dp.wait_seconds() - dp_wait0 + par_.tp_wait_seconds() - tp_wait0 + par_.cp_wait_seconds() - cp_wait0;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  if (pipeline_) {
    s.pipeline_idle = std::move(pipeline_idle);
    s.pipeline_bubble_theory = pipeline_->theoretical_bubble(static_cast<int>(n_micro));
  }
  s.step = step;
  s.total_steps = cfg_.train.steps;
  s.loss = mean_loss;
  s.skipped = !skip_reason.empty();
  s.skip_reason = skip_reason;
  s.skipped_steps = guard_.skipped_total();
  s.lr = lr;
  s.grad_norm = norm;
  s.step_seconds = seconds;
  const int64_t step_tokens = cfg_.train.batch_size * T;
  tokens_seen_ = step * step_tokens;
  elapsed_ += seconds;  // this process's steps only
  s.tokens = tokens_seen_;
  s.elapsed_seconds = elapsed_;
  s.tokens_per_s = static_cast<double>(step_tokens) / seconds;
  s.exposed_comm_seconds = exposed;
  s.comm_cpu_seconds = dp.comm_cpu_seconds() - comm_cpu0;
  if (tp_) s.comm_cpu_seconds += tp_->stats().comm_cpu_seconds - tp_cpu0;
  if (par_.cp && par_.cp != dp_) s.comm_cpu_seconds += par_.cp->stats().comm_cpu_seconds - cp_cpu0;
  s.mfu = peak_flops_ > 0 ? s.tokens_per_s * flops_per_token_ / (peak_flops_ * par_.world) : 0.0;
  return s;
}

void Trainer::inject_non_finite_gradient(int64_t step) {
  // Test-only fault: LOOM_FAULT_INJECT=nan_grad:DP_RANK:STEP[:COUNT] writes a NaN into the first summed
  // gradient element this data-parallel rank holds (tensor-parallel rank 0) at steps STEP .. STEP+COUNT-1.
  static const std::array<long, 3> when = [] {
    std::array<long, 3> w{-1, -1, 1};
    const char* f = std::getenv("LOOM_FAULT_INJECT");
    if (f && std::sscanf(f, "nan_grad:%ld:%ld:%ld", &w[0], &w[1], &w[2]) < 2) w = {-1, -1, 1};
    return w;
  }();
  if (when[0] != dp_rank_ || step < when[1] || step >= when[1] + when[2] || (tp_ && tp_->rank() != 0)) return;
  for (const auto& r : data_parallel_->gradient_pieces())
    if (r.size() > 0) {
      params_->grads().data<float>()[r.begin] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
}

void Trainer::load(int64_t first_sample, Split split) {
  profile::Span span(backend_.tracer(), "data_load", profile::Category::Host);
  // Test-only fault: a slow data loader (LOOM_FAULT_INJECT=slow_data:MS), for the profiler's host verdict.
  static const int slow_ms = [] {
    const char* f = std::getenv("LOOM_FAULT_INJECT");
    int ms = 0;
    return f && std::sscanf(f, "slow_data:%d", &ms) == 1 ? ms : 0;
  }();
  if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
  if (cp_ == 1) return data_->fill(tokens_, targets_, first_sample, split);
  data_->fill(whole_tokens_, whole_targets_, first_sample, split);
  const int64_t T = cfg_.seq_len(), Tl = local_seq_len();
  for (int64_t b = 0; b < cfg_.micro_batch(); ++b)
    for (int64_t t = 0; t < Tl; ++t) {
      const int64_t from = b * T + cp_positions_[static_cast<size_t>(t)], to = b * Tl + t;
      tokens_.data<int32_t>()[to] = whole_tokens_.data<int32_t>()[from];
      targets_.data<int32_t>()[to] = whole_targets_.data<int32_t>()[from];
    }
}

std::string Trainer::non_finite_gradient() const {
  // Under ZeRO only this rank's pieces hold summed gradients; the rest of the arena is scratch (stale,
  // or shared between blocks), so only the pieces are searched.
  const std::vector<spec::ArenaRange> scan = data_parallel_->gradient_pieces();
  const float* grads = params_->grads().data<float>();
  const auto& params = params_->table().params();
  int64_t first = static_cast<int64_t>(params.size()), element = 0;  // the first bad tensor of this rank
  for (size_t k = 0; k < params.size() && first == static_cast<int64_t>(params.size()); ++k)
    for (const auto& r : scan) {
      const auto& p = params[k];
      const int64_t begin = std::max(p.offset, r.begin), end = std::min(p.offset + p.numel(), r.end);
      if (begin >= end) continue;
      if (const int64_t bad = kernels::find_non_finite(grads + begin, end - begin); bad >= 0) {
        first = static_cast<int64_t>(k), element = begin - p.offset + bad;
        break;
      }
    }
  // The dp ranks share one table: the lowest bad tensor over the group, named on every rank.
  int64_t group_first = first;
  if (dp_) {
    comm::issue_and_wait(backend_.tracer(), "dp_scalar_min", 8, [&] {
      return dp_->all_reduce(&group_first, &group_first, 1, DType::I64, comm::ReduceOp::kMin);
    });
  }
  if (group_first < static_cast<int64_t>(params.size()))
    return fmt::format("the gradient of '{}' is non-finite{}", params[static_cast<size_t>(group_first)].name,
                       group_first == first ? fmt::format(" (element {} = {})", element,
                                                          grads[params[static_cast<size_t>(first)].offset + element])
                                            : std::string(" (on another data-parallel rank)"));
  if (pp_ || tp_)
    return "the gradient norm is non-finite (the gradients of another pipeline stage or tensor-parallel shard, or "
           "an overflow in the sum of squares)";
  return "the gradient norm is non-finite (an overflow in the sum of squares)";
}

int64_t Trainer::eval_batches() const {
  const int64_t windows = data_->samples(Split::Validation);
  if (windows <= 0) return cfg_.train.eval_batches;
  return std::min(cfg_.train.eval_batches, std::max<int64_t>(1, windows / cfg_.train.batch_size));
}

double Trainer::evaluate() {
  profile::Span span(backend_.tracer(), "eval", profile::Category::Step);
  data_parallel_->begin_micro_batch(false, false);
  // The validation set is the first eval_batches x batch_size samples of the validation split whatever
  // the layout: each dp rank takes its share of every batch, as in training, in micro-batches of its
  // size. So every layout evaluates the same samples, and every rank runs the same number of forwards
  // (ZeRO-3 gathers weights collectively in each).
  const int64_t B = cfg_.train.batch_size, mb = cfg_.micro_batch(), share = B / data_ranks_;
  double sum = 0;  // of micro-batch mean losses: all hold mb x T / cp targets, so their mean is the mean loss
  const int64_t batches = eval_batches();
  for (int64_t b = 0; b < batches; ++b) {
    if (pipeline_) {
      sum += pipeline_->evaluate(static_cast<int>(share / mb), tokens_, targets_, [&](int64_t m) {
        load(b * B + data_rank_ * share + m * mb, Split::Validation);
      });
      continue;
    }
    for (int64_t m = 0; m < share / mb; ++m) {
      load(b * B + data_rank_ * share + m * mb, Split::Validation);
      sum += model_->forward(ctx_, tokens_, targets_, 0.0f);
    }
  }
  return dp_sum(pp_sum(sum)) / static_cast<double>(batches * (B / mb) * cp_);
}

void Trainer::check_replicas(int64_t step) {
  const parallel::ReplicatedState same = data_parallel_->replicated();
  if (!dp_ || !same.weights) return;  // ZeRO-3 replicates no state: every rank holds different pieces
  profile::Span span(backend_.tracer(), "check_replicas", profile::Category::Host);
  // Fault injection for the test of this check: the last replica's first weight moves by one ulp.
  if (const char* f = std::getenv("LOOM_FAULT_INJECT"); f && std::string(f) == "replica_drift" && dp_rank_ == dp_size_ - 1) {
    if (params_->master().defined()) {
      float* w = params_->master().data<float>();
      w[0] = std::nextafter(w[0], 1e30f);
    }
    if (params_->lowp().defined()) params_->lowp().data<bf16>()[0].bits += 1;  // what sharded-master replicas compare
  }
  auto hash_of = [](const Tensor& t) { return t.numel() ? checksum64(t.raw(), t.nbytes()) : 0; };
  const bool moments = same.moments;
  // bf16-only weights are the bf16 arena.
  const uint64_t weights = hash_of(same.weights_as_lowp || params_->bf16_only() ? params_->lowp() : params_->master());
  const uint64_t mine[3] = {weights, moments ? hash_of(optimizer_->m()) : 0, moments ? hash_of(optimizer_->v()) : 0};
  std::vector<uint64_t> all(3 * static_cast<size_t>(dp_size_));
  dp_->all_gather(mine, all.data(), 3, DType::I64).wait();
  const char* what[3] = {"weights", "AdamW first moments", "AdamW second moments"};
  for (int r = 1; r < dp_size_; ++r)
    for (int k = 0; k < 3; ++k)
      if (all[3 * r + k] != all[k])
        throw NumericError("step " + std::to_string(step) + ": data-parallel replicas drifted: dp rank " +
                           std::to_string(r) + "'s " + what[k] + " differ from dp rank 0's (hash " +
                           checksum_hex(all[3 * r + k]) + " vs " + checksum_hex(all[k]) +
                           "); the ranks no longer train the same model. Report this with the config");
}

const spec::ParamTable& Trainer::full_table() const { return tp_ || pp_ ? whole_table_ : params_->table(); }

const float* Trainer::full_master() const {
  if (!tp_ && !pp_) return params_->master().data<float>();
  if (!whole_master_.numel()) throw Error("internal: a tensor- or pipeline-parallel checkpoint needs gather_full_state() first");
  return whole_master_.data<float>();
}

namespace {
// Collective over `group`: member r's state (three arena copies laid out by table_of(r)) lands on member
// 0 in `whole`, laid out by `target`, every element at its global place there (replicated elements
// arrive from each holder with the same bits; padding has no place). Member 0's own state is `mine`.
void gather_shards_on_first(comm::ProcessGroup& group, const std::function<spec::ParamTable(int)>& table_of,
                            const spec::ParamTable& target, const float* const mine[3], int64_t n_mine, Tensor* whole[3],
                            Allocator& alloc) {
  if (group.rank() != 0) {
    std::vector<comm::Work> works;
    for (int k = 0; k < 3; ++k) works.push_back(group.send(mine[k], static_cast<size_t>(n_mine), DType::F32, 0, kTpShardTag + k));
    for (auto& w : works) w.wait();
    return;
  }
  const MemCategory cats[3] = {MemCategory::Parameters, MemCategory::Optimizer, MemCategory::Optimizer};
  for (int k = 0; k < 3; ++k) *whole[k] = Tensor::empty({target.total_numel()}, DType::F32, alloc, cats[k]);
  for (int r = 0; r < group.size(); ++r) {
    const auto table = table_of(r);
    Tensor staged;
    const float* src[3] = {mine[0], mine[1], mine[2]};
    if (r != 0) {
      const int64_t n = table.total_numel();
      staged = Tensor::empty({3 * n}, DType::F32, alloc, MemCategory::Workspace);
      std::vector<comm::Work> works;
      for (int k = 0; k < 3; ++k) {
        works.push_back(group.recv(staged.data<float>() + k * n, static_cast<size_t>(n), DType::F32, r, kTpShardTag + k));
        src[k] = staged.data<float>() + k * n;
      }
      for (auto& w : works) w.wait();
    }
    for (const auto& p : table.params()) {
      const int64_t dst = target.at(p.name).offset;
      for (int64_t i = 0; i < p.numel(); ++i) {
        const int64_t g = table.global_element(p, i);
        if (g < 0) continue;
        for (int k = 0; k < 3; ++k) whole[k]->data<float>()[dst + g] = src[k][p.offset + i];
      }
    }
  }
}
}  // namespace

void Trainer::gather_model_shards() {
  // Only dp rank 0's replica is saved: its tp shards are gathered on tp rank 0 of each pipeline stage
  // (the stage's whole tensors), then the stages on pipeline rank 0 (global rank 0).
  if ((!tp_ && !pp_) || dp_rank_ != 0) return;
  Allocator& alloc = backend_.allocator();
  const auto& m = cfg_.model.resolved;
  const spec::TableShard stage = pp_ ? par_.stages.shard_of(pp_->rank()) : spec::TableShard{};
  const Moments local = data_parallel_->full_moments(optimizer_->m().data<float>(), optimizer_->v().data<float>());
  const float* mine[3] = {params_->master().data<float>(), local.m, local.v};
  int64_t n_mine = params_->table().total_numel();
  Tensor stage_whole[3];
  if (tp_) {
    const spec::ParamTable stage_table = spec::build_param_table(m, stage);
    Tensor* into[3] = {&stage_whole[0], &stage_whole[1], &stage_whole[2]};
    gather_shards_on_first(*tp_, [&](int r) {
      spec::TableShard s = stage;
      s.tp_rank = r, s.tp_size = tp_->size();
      return spec::build_param_table(m, s);
    }, stage_table, mine, n_mine, into, alloc);
    if (tp_->rank() != 0) return;
    for (int k = 0; k < 3; ++k) mine[k] = stage_whole[k].data<float>();
    n_mine = stage_table.total_numel();
  }
  Tensor* into[3] = {&whole_master_, &whole_m_, &whole_v_};
  whole_table_ = spec::build_param_table(m);
  if (!pp_) {
    for (int k = 0; k < 3; ++k) *into[k] = std::move(stage_whole[k]);
    return;
  }
  gather_shards_on_first(*pp_, [&](int r) { return spec::build_param_table(m, par_.stages.shard_of(r)); }, whole_table_,
                         mine, n_mine, into, alloc);
}

Trainer::Moments Trainer::full_moments() const {
  if (tp_ || pp_) {
    if (!whole_m_.numel()) throw Error("internal: a tensor- or pipeline-parallel checkpoint needs gather_full_state() first");
    return {whole_m_.data<float>(), whole_v_.data<float>()};
  }
  return data_parallel_->full_moments(optimizer_->m().data<float>(), optimizer_->v().data<float>());
}

void Trainer::gather_full_state() {
  data_parallel_->gather_full_state(optimizer_->m().data<float>(), optimizer_->v().data<float>(), backend_.allocator());
  gather_model_shards();
}

void Trainer::release_full_state() {
  data_parallel_->release_full_state();
  whole_master_ = whole_m_ = whole_v_ = Tensor();
}

std::vector<spec::ArenaRange> Trainer::weights_held() const { return data_parallel_->weights_held(); }

size_t Trainer::on_demand_resident_bytes() const {
  size_t n = 0;
  for (const PageReservation* r : {params_->master_pages(), params_->lowp_pages(), params_->grad_pages()})
    if (r) n += r->resident_bytes();
  return n;
}

void Trainer::weights_changed() {
  if (fp8_) fp8_->weights_changed();
  const auto held = weights_held();
  params_->refresh_lowp(held);
  data_parallel_->weights_changed();
}

void Trainer::check_pipeline_messages_fit() const {
  // The executor waits for each action's send (grouped with the next action's receive) before it runs
  // the next action. Under interleaving a send can then wait on a peer that waits on this rank (issue 13's
  // review: rank 0 sends a gradient while rank 1 sends one back and wants an activation), unless the
  // channel takes the whole message without its receiver. GPipe, 1F1B and zb-h1 never need that.
  if (spec::parse_schedule(cfg_.parallel.pipeline_schedule) != spec::PipelineSchedule::Interleaved1F1B) return;
  const bool bf16_wire = cfg_.precision == model::Precision::BF16 && cfg_.parallel.pipeline_bf16_transfers;
  const int64_t rows = cfg_.micro_batch() * local_seq_len() / par_.ops->sequence_shards();
  const auto bytes = static_cast<size_t>(rows * cfg_.model.resolved.d_model * (bf16_wire ? 2 : 4));
  const size_t buffered = pp_->buffered_message_bytes();
  if (bytes <= buffered) return;
  const auto mib = [](size_t b) { return fmt::format("{:.2f} MiB", static_cast<double>(b) / 1048576.0); };
  throw ConfigError(fmt::format(
      "parallel.pipeline.schedule = \"interleaved-1f1b\" sends {} per transfer ({} rows x {} wide, {}), more than the "
      "{} a {} pipeline channel takes without its receiver: interleaved stages could then wait on each other "
      "forever. Use \"zb-h1\" or \"1f1b\", or a smaller train.micro_batch_size or train.seq_len{}",
      mib(bytes), rows, cfg_.model.resolved.d_model, bf16_wire ? "bf16" : "f32", mib(buffered),
      pp_->transport_name(), cfg_.precision == model::Precision::BF16 && !bf16_wire
                                 ? ", or parallel.pipeline.bf16_transfers = true"
                                 : ""));
}

void Trainer::end_moe_step(StepMetrics& s, bool applied) {
  const auto& mc = cfg_.model.resolved;
  if (!mc.moe.enabled()) return;
  const int64_t E = mc.moe.experts;
  std::vector<int64_t> layers;
  for (int64_t l = 0; l < mc.n_layers; ++l)
    if (mc.is_moe_layer(l)) layers.push_back(l);
  // Per block: routed[E], dropped, pairs, aux-loss sum, micro-batches; zeros for blocks another
  // pipeline stage holds, so one sum over dp and pp gives every block's step.
  const size_t width = static_cast<size_t>(E) + 4;
  std::vector<double> sums(layers.size() * width, 0.0);
  for (size_t i = 0; i < layers.size(); ++i) {
    const model::MoeLoad& m = model_->moe_load()[static_cast<size_t>(layers[i])];
    double* row = sums.data() + i * width;
    for (size_t e = 0; e < m.routed.size(); ++e) row[e] = static_cast<double>(m.routed[e]);
    row[E] = static_cast<double>(m.dropped), row[E + 1] = static_cast<double>(m.pairs);
    row[E + 2] = m.aux_loss, row[E + 3] = static_cast<double>(m.micro_batches);
  }
  model_->reset_moe_load();
  for (comm::ProcessGroup* g : {dp_, pp_}) {
    if (!g) continue;
    comm::issue_and_wait(backend_.tracer(), "moe_load_reduce", static_cast<double>(sums.size() * sizeof(double)), [&] {
      return g->all_reduce(sums.data(), sums.data(), sums.size(), DType::F64, comm::ReduceOp::kSum);
    });
  }
  const auto held = weights_held();
  for (size_t i = 0; i < layers.size(); ++i) {
    const double* row = sums.data() + i * width;
    MoeBlockLoad b;
    b.layer = layers[i];
    double busiest = 0;
    for (int64_t e = 0; e < E; ++e) b.routed.push_back(static_cast<int64_t>(row[e])), busiest = std::max(busiest, row[e]);
    b.dropped = static_cast<int64_t>(row[E]);
    const double mean = row[E + 1] / static_cast<double>(E);
    b.imbalance = mean > 0 ? busiest / mean : 0.0;
    b.aux_loss = row[E + 3] > 0 ? row[E + 2] / row[E + 3] : 0.0;
    if (profile::Tracer* t = backend_.tracer(); t && t->mode() == profile::Tracer::Mode::Full) {
      std::vector<std::pair<std::string, double>> per;
      for (int64_t e = 0; e < E; ++e) per.emplace_back("expert " + std::to_string(e), row[e]);
      t->counter(fmt::format("moe tokens per expert (block {})", b.layer), std::move(per));
      t->counter(fmt::format("moe dropped (block {})", b.layer), {{"dropped", row[E]}});
    }
    s.moe.push_back(std::move(b));
    // DeepSeek-V3's balancing: each expert's bias moves by the rate toward the mean load (up when
    // under-loaded). The same counts on every rank, so the same bias; each rank writes the elements it
    // holds (ZeRO-3: its pieces), after the optimizer, which leaves the bias alone (its gradient is 0).
    if (!applied || mc.moe.bias_update_rate <= 0 || row[E + 1] <= 0) continue;
    const std::string name = spec::moe_param_prefix(mc, layers[i]) + "gate.e_score_correction_bias";
    const auto index = params_->table().index_of(name);
    if (!index) continue;  // another pipeline stage's block
    const spec::ParamSpec& p = params_->table().params()[*index];
    const std::vector<spec::ArenaRange> whole{{p.offset, p.offset + E}};
    const auto mine = held.empty() ? whole : spec::intersect(whole, held);
    for (const auto& r : mine) {
      std::vector<float> v(static_cast<size_t>(r.size()));
      params_->read_f32(r.begin, r.size(), v.data());
      for (int64_t i = 0; i < r.size(); ++i) {
        const double gap = mean - row[r.begin - p.offset + i];
        v[static_cast<size_t>(i)] += static_cast<float>(mc.moe.bias_update_rate) * static_cast<float>((gap > 0) - (gap < 0));
      }
      params_->write_f32(r.begin, r.size(), v.data());
    }
    if (!mine.empty()) params_->refresh_lowp(mine);  // (an empty list would mean every element)
  }
}

void Trainer::end_fp8_step(StepMetrics& s) {
  if (!fp8_) return;
  fp8_->end_step([&](std::span<float> amax, std::span<double> counts) {
    // Every group the model is split over: the same tensor's amax on every rank (delayed scaling then
    // scales alike under any layout), and counts over everything quantised.
    for (comm::ProcessGroup* g : {dp_, tp_, pp_}) {
      if (!g) continue;
      comm::issue_and_wait(backend_.tracer(), "fp8_amax_reduce", static_cast<double>(amax.size_bytes()), [&] {
        return g->all_reduce(amax.data(), amax.data(), amax.size(), DType::F32, comm::ReduceOp::kMax);
      });
      comm::issue_and_wait(backend_.tracer(), "fp8_count_reduce", static_cast<double>(counts.size_bytes()), [&] {
        return g->all_reduce(counts.data(), counts.data(), counts.size(), DType::F64, comm::ReduceOp::kSum);
      });
    }
  });
  s.fp8 = true;
  s.fp8_overflow = fp8_->last_step_overflow();
  s.fp8_underflow = fp8_->last_step_underflow();
  s.fp8_tensors = fp8_->last_step_counts();
}

double Trainer::dp_sum(double v) const {
  if (dp_)
    comm::issue_and_wait(backend_.tracer(), "dp_scalar_sum", 8, [&] {
      return dp_->all_reduce(&v, &v, 1, DType::F64, comm::ReduceOp::kSum);
    });
  return v;
}

double Trainer::tp_sum(double v) const {
  if (tp_)
    comm::issue_and_wait(backend_.tracer(), "tp_scalar_sum", 8, [&] {
      return tp_->all_reduce(&v, &v, 1, DType::F64, comm::ReduceOp::kSum);
    });
  return v;
}

double Trainer::pp_sum(double v) const {
  // Scalars summed over the pipeline: where a stage that finished early waits for the others.
  if (pp_)
    comm::issue_and_wait(backend_.tracer(), "pp_scalar_sum", 8, [&] {
      return pp_->all_reduce(&v, &v, 1, DType::F64, comm::ReduceOp::kSum);
    });
  return v;
}

const char* Trainer::embedding_name() const {
  return spec::token_embedding_name(cfg_.model.resolved.arch);
}

void Trainer::sum_tied_embedding_grads() {
  const auto& st = par_.stages;
  const int head = st.rank_of(st.chunks() - 1);
  if (!pp_ || !cfg_.model.resolved.tie_embeddings || head == 0) return;
  const int me = pp_->rank();
  if (me != 0 && me != head) return;
  // Both copies' gradients, added on both ranks in the same order (a + b is b + a exactly), so the two
  // copies take the same step.
  const Tensor g = params_->grad(embedding_name());
  Tensor theirs = Tensor::empty({g.numel()}, DType::F32, backend_.allocator(), MemCategory::Workspace);
  const int other = me == 0 ? head : 0;
  const comm::ProcessGroup::PeerOp ops[] = {
      {true, g.raw(), static_cast<size_t>(g.numel()), DType::F32, other, kTiedEmbeddingTag},
      {false, theirs.raw(), static_cast<size_t>(g.numel()), DType::F32, other, kTiedEmbeddingTag}};
  comm::issue_and_wait(backend_.tracer(), "pp_tied_embedding_sum", 2.0 * static_cast<double>(g.nbytes()),
                       [&] { return pp_->send_recv_many(ops); });
  backend_.add(g.reshape({g.numel()}), g.reshape({g.numel()}), theirs);
}

double Trainer::gradient_norm() const {
  // Under ZeRO each rank holds the summed gradient of its pieces only; across tp, replicated tensors
  // are counted on their first holder only.
  std::vector<spec::ArenaRange> mine = data_parallel_->gradient_pieces();
  if (tp_) mine = spec::intersect(mine, spec::counted_ranges(params_->table()));
  const auto& shard = params_->table().shard();
  if (pp_ && shard.head && !shard.embeddings && cfg_.model.resolved.tie_embeddings) {
    // The last stage's copy of a tied embedding is counted on the first stage.
    const auto& e = params_->table().at(embedding_name());
    std::vector<spec::ArenaRange> rest;
    for (const auto& r : mine) {
      if (r.begin < e.offset) rest.push_back({r.begin, std::min(r.end, e.offset)});
      if (r.end > e.offset + e.numel()) rest.push_back({std::max(r.begin, e.offset + e.numel()), r.end});
    }
    mine = rest;
  }
  double sq = 0;
  {
    int64_t n = 0;
    for (const auto& r : mine) n += r.size();
    const kernels::KernelCost c = kernels::sum_squares_cost(n);
    profile::Span span(backend_.tracer(), "grad_norm", profile::Category::Kernel, c.flops, c.bytes);
    sq = grad_sum_squares(*params_, mine);
  }
  if (par_.ep_size() > 1 && !data_parallel_->gradients_sharded()) {
    // Each ep rank holds other experts: their squares add up over the ep group, the rest is replicated.
    // (Under ZeRO each element has one owner among all the replicas: the dp sum below covers them.)
    const auto experts = spec::expert_ranges(params_->table());
    double ex = grad_sum_squares(*params_, spec::intersect(mine, experts));
    sq -= ex;
    comm::issue_and_wait(backend_.tracer(), "ep_norm_reduce", 8, [&] {
      return par_.ep->all_reduce(&ex, &ex, 1, DType::F64, comm::ReduceOp::kSum);
    });
    sq += ex;
  }
  if (data_parallel_->gradients_sharded()) sq = dp_sum(sq);
  return std::sqrt(pp_sum(tp_sum(sq)));
}

void Trainer::run(const std::function<bool(const StepMetrics&)>& on_step) {
  for (int64_t step = start_step_ + 1; step <= cfg_.train.steps; ++step) {
    StepMetrics s = train_step(step);
    const bool eval_now = cfg_.train.eval_every > 0 && (step % cfg_.train.eval_every == 0 || step == cfg_.train.steps);
    if (eval_now) s.val_loss = evaluate();
    if (on_step && !on_step(s)) break;
  }
}

}  // namespace loom::train
