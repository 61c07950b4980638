#include "loom/kernels/layer_ops.h"

namespace loom::kernels {

namespace {
const Tensor* bias(const LinearWeights& l) { return l.has_bias() ? &l.b : nullptr; }
const Tensor* dbias(const LinearWeights& l) { return l.has_bias() ? &l.db : nullptr; }
}  // namespace

void LayerOps::column_forward(const Tensor& y, const Tensor& x, const LinearWeights& l) {
  be_.linear_forward(y, x, l.w, bias(l), false);
}

void LayerOps::column_backward(const Tensor* dx, const LinearWeights& l, const Tensor& dy, const Tensor& x) {
  be_.linear_backward(dx, false, l.dw, dbias(l), dy, x, l.w);
}

void LayerOps::row_forward_add(const Tensor& y, const Tensor& residual, const Tensor& x, const LinearWeights& l) {
  if (residual.raw() == y.raw())
    be_.linear_forward(y, x, l.w, bias(l), true);
  else
    be_.linear_forward_add(y, residual, x, l.w, bias(l));
}

void LayerOps::add_group_sum(const Tensor& y, const Tensor& partial) { add_group_sum(y, y, partial); }

void LayerOps::add_group_sum(const Tensor& y, const Tensor& residual, const Tensor& partial) {
  be_.add(y, residual, partial);
}

void LayerOps::row_backward(const Tensor& dx, const LinearWeights& l, const Tensor& dy, const Tensor& x) {
  be_.linear_backward(&dx, false, l.dw, dbias(l), dy, x, l.w);
}

void LayerOps::linear_backward_input(const Tensor& dx, const LinearWeights& l, const Tensor& dy, const Tensor& x) {
  be_.linear_backward(&dx, false, Tensor(), nullptr, dy, x, l.w);
}

void LayerOps::linear_backward_weight(const LinearWeights& l, const Tensor& dy, const Tensor& x) {
  be_.linear_backward(nullptr, false, l.dw, dbias(l), dy, x, l.w);
}

void LayerOps::embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) {
  be_.embedding_forward(out, tokens, wte, wpe);
}

void LayerOps::embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) {
  be_.embedding_backward(dwte, dwpe, dout, tokens);
}

void LayerOps::cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets, int64_t /*vocab_size*/,
                             float grad_scale) {
  if (grad_scale > 0)
    be_.softmax_cross_entropy(losses, logits, targets, grad_scale);
  else
    be_.cross_entropy_forward(losses, logits, targets);
}

}  // namespace loom::kernels
