#include "loom/train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "loom/core/checksum.h"
#include "loom/error.h"
#include "loom/kernels/elementwise.h"

namespace loom::train {

Trainer::Trainer(const RunConfig& cfg, kernels::Backend& backend, double peak_flops, comm::ProcessGroup* dp)
    : cfg_(cfg),
      backend_(backend),
      dp_(dp && dp->size() > 1 ? dp : nullptr),
      dp_size_(dp_ ? dp_->size() : 1),
      dp_rank_(dp_ ? dp_->rank() : 0),
      peak_flops_(peak_flops),
      flops_per_token_(spec::model_flops_per_token(cfg.model.resolved, cfg.seq_len())),
      schedule_{cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, cfg.train.steps},
      data_(make_token_source(cfg)) {
  cfg_.validate();
  if (dp_size_ != cfg_.parallel.dp)
    throw ConfigError("parallel.dp = " + std::to_string(cfg_.parallel.dp) + " but the data-parallel group has " +
                      std::to_string(dp_size_) + " rank(s): start parallel.dp ranks (loom run -n " +
                      std::to_string(cfg_.parallel.dp) + " -- loom train ...)");
  Allocator& alloc = backend_.allocator();
  params_ = std::make_unique<model::ParameterStore>(spec::build_param_table(cfg_.model.resolved), cfg_.precision, alloc);
  params_->initialize(cfg_.train.seed);
  model_ = std::make_unique<model::Transformer>(cfg_.model.resolved, *params_, backend_);
  // ZeRO-1: dp rank r owns arena elements [r*chunk, (r+1)*chunk), the last rank also the remainder.
  const int64_t total = params_->table().total_numel();
  int64_t lo = 0, hi = total;
  if (dp_ && cfg_.parallel.zero >= 1) {
    const int64_t chunk = total / dp_size_;
    for (int r = 0; r < dp_size_; ++r)
      shard_counts_.push_back(static_cast<size_t>(r == dp_size_ - 1 ? total - r * chunk : chunk));
    lo = dp_rank_ * chunk;
    hi = lo + static_cast<int64_t>(shard_counts_[dp_rank_]);
  }
  optimizer_ = std::make_unique<AdamW>(
      *params_, AdamWConfig{cfg_.train.beta1, cfg_.train.beta2, cfg_.train.eps, cfg_.train.weight_decay}, alloc, lo, hi);
  ctx_ = model_->make_context(cfg_.micro_batch(), cfg_.seq_len());
  if (dp_ && shard_counts_.empty()) {
    buckets_ = std::make_unique<parallel::GradBuckets>(params_->table(), params_->grads().data<float>(), *dp_,
                                                       static_cast<size_t>(cfg_.parallel.bucket_kb) << 10);
    block_starts_ = params_->table().block_starts(cfg_.model.resolved.n_layers);
  }
  tokens_ = Tensor::empty({cfg_.micro_batch(), cfg_.seq_len()}, DType::I32, alloc, MemCategory::Activations);
  targets_ = Tensor::empty({cfg_.micro_batch(), cfg_.seq_len()}, DType::I32, alloc, MemCategory::Activations);
}

StepMetrics Trainer::train_step(int64_t step) {
  profile::Tracer* tracer = backend_.tracer();
  profile::Span step_span(tracer, "step", profile::Category::Step);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t mb = cfg_.micro_batch(), T = cfg_.seq_len();
  // Data order is a function of the global sample index: dp rank r runs the r-th share of the batch.
  const int64_t share = cfg_.train.batch_size / dp_size_;
  const int64_t n_micro = share / mb;
  const int64_t first = (step - 1) * cfg_.train.batch_size + dp_rank_ * share;
  // Every sample holds T targets (no padding), so the loss is the mean over batch * T of them.
  const float grad_scale = 1.0f / static_cast<float>(cfg_.train.batch_size * T);
  params_->zero_grads();
  double loss_sum = 0;
  double exposed = 0;  // seconds this thread waited on dp collectives
  const double comm_cpu0 = dp_ ? dp_->stats().comm_cpu_seconds : 0;
  auto timed = [&exposed](auto&& f) {
    const auto w0 = std::chrono::steady_clock::now();
    f();
    exposed += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  };
  for (int64_t m = 0; m < n_micro; ++m) {
    data_->fill(tokens_, targets_, first + m * mb, Split::Train);
    double loss = model_->forward(ctx_, tokens_, targets_, grad_scale);
    if (!std::isfinite(loss))
      throw NumericError("step " + std::to_string(step) + ": loss is " + std::to_string(loss) + " in micro-batch " +
                         std::to_string(m) + "; lower train.lr or check the data");
    loss_sum += loss;
    if (buckets_ && m == n_micro - 1) {
      // Last micro-batch: each bucket is all-reduced as soon as backward has made it final. Gradients
      // were scaled by the global sample count, so the sum over replicas is the batch gradient.
      buckets_->begin();
      model_->backward(ctx_, [&](int64_t l) { buckets_->ready_from(l >= 0 ? block_starts_[l] : 0); });
    } else {
      model_->backward(ctx_);
    }
  }
  double norm = 0;
  if (buckets_) {
    profile::Span span(tracer, "dp_all_reduce_wait", profile::Category::Communication, 0,
                       static_cast<double>(params_->grads().numel()) * 4);
    timed([&] { buckets_->finish(); });
  } else if (dp_) {
    timed([&] { reduce_scatter_gradients(); });
  }
  if (dp_) loss_sum = dp_sum(loss_sum);
  if (optimizer_->sharded()) {  // each rank holds the summed gradient of its shard only
    norm = std::sqrt(dp_sum(grad_sum_squares(*params_, optimizer_->shard_begin(), optimizer_->shard_end())));
  } else {
    norm = global_grad_norm(*params_);
  }
  if (!std::isfinite(norm)) check_finite_gradients(step);
  const double clip = cfg_.train.grad_clip > 0 && norm > cfg_.train.grad_clip ? cfg_.train.grad_clip / norm : 1.0;
  const double lr = schedule_.at(step);
  optimizer_->step(lr, clip, tracer);
  if (optimizer_->sharded()) timed([&] { all_gather_parameters(); });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  StepMetrics s;
  s.step = step;
  s.total_steps = cfg_.train.steps;
  s.loss = loss_sum / static_cast<double>(n_micro * dp_size_);
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
  s.comm_cpu_seconds = dp_ ? dp_->stats().comm_cpu_seconds - comm_cpu0 : 0;
  s.mfu = peak_flops_ > 0 ? s.tokens_per_s * flops_per_token_ / (peak_flops_ * dp_size_) : 0.0;
  return s;
}

void Trainer::check_finite_gradients(int64_t step) const {
  for (const auto& p : params_->table().params()) {
    Tensor g = params_->grad(p.name);
    int64_t bad = kernels::find_non_finite(g.data<float>(), g.numel());
    if (bad >= 0)
      throw NumericError("step " + std::to_string(step) + ": gradient of '" + p.name + "' is non-finite (element " +
                         std::to_string(bad) + " = " + std::to_string(g.data<float>()[bad]) +
                         "); lower train.lr or set train.grad_clip");
  }
  throw NumericError("step " + std::to_string(step) + ": gradient norm is non-finite (overflow in the sum of squares)");
}

double Trainer::evaluate() {
  profile::Span span(backend_.tracer(), "eval", profile::Category::Step);
  double sum = 0;
  for (int64_t i = dp_rank_; i < cfg_.train.eval_batches; i += dp_size_) {  // dp ranks split the batches
    data_->fill(tokens_, targets_, i * cfg_.micro_batch(), Split::Validation);
    sum += model_->forward(ctx_, tokens_, targets_, 0.0f);
  }
  return dp_sum(sum) / static_cast<double>(cfg_.train.eval_batches);
}

void Trainer::check_replicas(int64_t step) {
  if (!dp_) return;
  profile::Span span(backend_.tracer(), "check_replicas", profile::Category::Host);
  // Fault injection for the test of this check: the last replica's first weight moves by one ulp.
  if (const char* f = std::getenv("LOOM_FAULT_INJECT"); f && std::string(f) == "replica_drift" && dp_rank_ == dp_size_ - 1) {
    float* w = params_->master().data<float>();
    w[0] = std::nextafter(w[0], 1e30f);
  }
  auto hash_of = [](const Tensor& t) { return t.numel() ? checksum64(t.data<float>(), t.numel() * sizeof(float)) : 0; };
  // Under ZeRO-1 the moments are shards, different by design: only the weights must agree.
  const bool moments = !optimizer_->sharded();
  const uint64_t mine[3] = {hash_of(params_->master()), moments ? hash_of(optimizer_->m()) : 0,
                            moments ? hash_of(optimizer_->v()) : 0};
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

// ZeRO-1: the sum of every rank's gradient lands only in the shard its owner updates.
void Trainer::reduce_scatter_gradients() {
  profile::Span span(backend_.tracer(), "zero_reduce_scatter", profile::Category::Communication, 0,
                     static_cast<double>(params_->grads().numel()) * 4);
  float* g = params_->grads().data<float>();
  const size_t chunk = shard_counts_[0];
  const size_t even = chunk * static_cast<size_t>(dp_size_);
  if (chunk > 0) dp_->reduce_scatter(g, g + dp_rank_ * chunk, chunk, DType::F32, comm::ReduceOp::kSum).wait();
  // The remainder after dp equal chunks (fewer than dp elements) belongs to the last rank.
  const size_t tail = static_cast<size_t>(params_->table().total_numel()) - even;
  if (tail > 0) dp_->all_reduce(g + even, g + even, tail, DType::F32, comm::ReduceOp::kSum).wait();
}

// ZeRO-1: every rank updated its shard of the weights; all of them need all of it for the next step.
void Trainer::all_gather_parameters() {
  profile::Span span(backend_.tracer(), "zero_all_gather", profile::Category::Communication, 0,
                     static_cast<double>(params_->master().numel()) * 4);
  float* w = params_->master().data<float>();
  dp_->all_gather_v(w + optimizer_->shard_begin(), w, shard_counts_, DType::F32).wait();
  params_->refresh_lowp();
}

Trainer::Moments Trainer::full_moments() const {
  if (!optimizer_->sharded()) return {optimizer_->m().data<float>(), optimizer_->v().data<float>()};
  if (!gathered_m_.numel())
    throw Error("internal: a ZeRO-1 checkpoint needs gather_optimizer_state() on every rank first");
  return {gathered_m_.data<float>(), gathered_v_.data<float>()};
}

void Trainer::gather_optimizer_state() {
  if (!optimizer_->sharded()) return;
  Allocator& alloc = backend_.allocator();
  const int64_t total = params_->table().total_numel();
  gathered_m_ = Tensor::empty({total}, DType::F32, alloc, MemCategory::Optimizer);
  gathered_v_ = Tensor::empty({total}, DType::F32, alloc, MemCategory::Optimizer);
  dp_->all_gather_v(optimizer_->m().data<float>(), gathered_m_.data<float>(), shard_counts_, DType::F32).wait();
  dp_->all_gather_v(optimizer_->v().data<float>(), gathered_v_.data<float>(), shard_counts_, DType::F32).wait();
}

void Trainer::release_optimizer_state() {
  gathered_m_ = Tensor();
  gathered_v_ = Tensor();
}

double Trainer::dp_sum(double v) const {
  if (dp_) dp_->all_reduce(&v, &v, 1, DType::F64, comm::ReduceOp::kSum).wait();
  return v;
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
