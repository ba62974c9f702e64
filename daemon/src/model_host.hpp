// What serves completions: the model, its compute ops, the runtime over the engine, and the
// scheduler whose thread drives them. Built at boot by a ModelFactory, so the daemon's unit tests
// can serve from a stand-in runtime; the real one (real_model_factory) lives with the backends.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "model_text.hpp"
#include "profile.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/core/model/runtime.hpp"
#include "writescope/core/model/scheduler.hpp"

namespace writescope::daemon {

struct ModelHost {
    // Declared in dependency order: destroyed scheduler first (its thread joins), model last.
    std::unique_ptr<model::Model> model;
    std::unique_ptr<model::ModelOps> ops;
    std::unique_ptr<model::Runtime> runtime;
    std::unique_ptr<model::Scheduler> scheduler;
    std::string kernel;       // the expert/GEMM kernels ("avx512-bf16", ...)
    int expert_threads = 0;   // threads of the ops' pool
    double load_seconds = 0;  // loading (or generating) the weights
    ModelText text;           // a model directory's tokenizer and chat template, if any
};

// Builds the ModelHost for a profile over a started engine (whose geometry is the model's).
// status(stage) reports progress. Throws std::runtime_error naming what failed.
using ModelFactory =
    std::function<std::unique_ptr<ModelHost>(const Profile&, std::string_view source, Engine&,
                                             const std::function<void(std::string_view)>& status)>;

// The real one: load_profile_model, CpuModelOps (hardware.expert_threads), make_runtime and
// the scheduler (kv.max_batch sequences, server.max_queued_requests waiting).
ModelFactory real_model_factory();

}  // namespace writescope::daemon
