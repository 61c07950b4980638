// Collectives a parallel op issues now and waits for later, timed and traced the same way for every
// axis (tensor-, context-parallel): the wait is exposed communication (Communication span
// "<name>.wait"), issue to completion the op's time in flight (InFlight span "<name>").
#pragma once

#include <cstdint>

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"
#include "loom/profile/tracer.h"

namespace loom::parallel {

class InFlight {
 public:
  explicit InFlight(kernels::Backend& backend) : be_(backend) {}
  struct Pending {
    comm::Work work;
    int64_t issued_ns = 0;
    const char* name = nullptr;
    const char* wait_name = nullptr;
    double bytes = 0;
  };
  Pending issue(comm::Work work, const char* name, const char* wait_name, double bytes) const {
    return {std::move(work), profile::Tracer::now_ns(), name, wait_name, bytes};
  }
  void wait(Pending& p) {
    const int64_t w0 = profile::Tracer::now_ns();
    p.work.wait();
    const int64_t w1 = profile::Tracer::now_ns();
    wait_seconds_ += 1e-9 * static_cast<double>(w1 - w0);
    in_flight_seconds_ += 1e-9 * static_cast<double>(w1 - p.issued_ns);
    if (profile::Tracer* t = be_.tracer(); t && t->on()) {
      const profile::ScopedSpanContext restore(profile::SpanContext::kNoUnit);
      comm::mark_wait(p.work);
      t->record(p.wait_name, profile::Category::Communication, w0, w1, 0, p.bytes);
      t->record(p.name, profile::Category::InFlight, p.issued_ns, w1, 0, p.bytes);
    }
  }
  // Wall seconds this thread waited (cumulative): exposed communication.
  double wait_seconds() const { return wait_seconds_; }
  // Wall seconds the ops were in flight, from issue to completion (cumulative).
  double in_flight_seconds() const { return in_flight_seconds_; }

 private:
  kernels::Backend& be_;  // its tracer, read at each wait (set after the ops are built)
  double wait_seconds_ = 0, in_flight_seconds_ = 0;
};

}  // namespace loom::parallel
