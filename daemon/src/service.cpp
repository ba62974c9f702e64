#include "service.hpp"

#include <bit>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "engine_options.hpp"
#include "log.hpp"
#include "units.hpp"
#include "writescope/core/policy_state.hpp"

namespace writescope::daemon {
namespace {

std::int64_t unix_s_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

}  // namespace

std::int64_t unix_ms_now() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

std::string_view phase_name(Phase p) noexcept {
    switch (p) {
        case Phase::starting:
            return "starting";
        case Phase::ready:
            return "ready";
        case Phase::stopping:
            return "stopping";
    }
    return "?";
}

std::string geometry_key(const EngineOptions& o) {
    const auto& g = o.geometry;
    return fmt::format("{}:layers={}:q_heads={}:kv_heads={}:dk={}:dv={}:mla={}:block={}", g.name,
                       g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v,
                       g.mla ? 1 : 0, o.block_tokens);
}

WorkloadRecord workload_record_of(std::string_view policy_state, const EngineStatus& s) {
    const PolicyState st = parse_policy_state(policy_state);
    WorkloadRecord r;
    r.key = {st.key.model, std::string(dtype_name(st.key.kv_dtype)),
             static_cast<std::int64_t>(st.key.batch_bucket),
             static_cast<std::int64_t>(st.key.context_bucket)};
    r.a = st.a.estimate;
    r.b = st.b.estimate;
    r.delta = st.delta.estimate;
    r.r_deployed = st.r_deployed;
    r.r_target = s.r_target;
    r.steps = st.step_seconds.count;
    r.step_seconds_mean = st.step_seconds.mean;
    r.step_seconds_stddev = st.step_seconds.stddev();
    r.step_seconds_min = st.step_seconds.min;
    r.step_seconds_max = st.step_seconds.max;
    r.policy_state = std::string(policy_state);
    r.updated_at = unix_s_now();
    return r;
}

Service::Service(Profile profile, std::string profile_source, EngineOptions options,
                 MachineInfo machine, EngineFactory factory, AllocatorInfo allocator,
                 ModelFactory model_factory)
    : profile_source_(std::move(profile_source)),
      options_(std::move(options)),
      machine_(std::move(machine)),
      factory_(std::move(factory)),
      allocator_(std::move(allocator)),
      model_factory_(std::move(model_factory)),
      started_at_ms_(unix_ms_now()),
      profile_(std::move(profile)) {}

Service::~Service() {
    request_stop();
    if (job_thread_.joinable()) job_thread_.join();
}

void Service::set_stage(const StatusFn& status, std::string stage) {
    {
        std::lock_guard lock(state_mu_);
        stage_ = stage;
    }
    if (status) status(stage);
}

void Service::boot(const StatusFn& status) {
    const Profile profile = this->profile();
    set_stage(status, "opening the store");
    {
        auto store = Store::open(profile.storage.state_dir, [&] {
            set_stage(status, fmt::format("opening the store: waiting for another process's "
                                          "lock ({} s at most)",
                                          Store::lock_wait_seconds()));
        });
        std::lock_guard lock(state_mu_);
        store_ = std::move(store);
    }
    if (cancel_) throw std::runtime_error("stopped during boot");

    // hardware.vram_kv_budget "auto": G sized by the KV the stored decode steps held.
    if (!profile.hardware.vram_kv_budget && options_.gpu_index >= 0) {
        model::KvDemand demand;
        try {
            demand = store_->kv_demand(options_.geometry.name, dtype_name(options_.geometry.dtype));
        } catch (const StoreError& e) {
            log_warning("store.read-failed", "cannot read the KV history: {}", e.what());
        }
        try {
            AutoKv a;
            EngineOptions o = engine_options_from_profile(profile, machine_, profile_source_,
                                                          nullptr, &demand, &a);
            log_info("kv.vram-auto", "hardware.vram_kv_budget \"auto\": {}", a.detail);
            std::lock_guard lock(state_mu_);
            options_ = std::move(o);
            kv_auto_ = std::move(a);
        } catch (const std::exception& e) {
            // It passed at start-up; a model directory changed since is the engine's to meet.
            log_warning("kv.vram-auto-failed",
                        "hardware.vram_kv_budget \"auto\" kept its start-up size: {}", e.what());
        }
    }

    set_stage(status,
              fmt::format("starting the engine ({}, {})", options_.geometry.name,
                          options_.gpu_index >= 0 ? fmt::format("GPU {}", options_.gpu_index)
                                                  : std::string("CPU only")));
    std::unique_lock engine_lock(engine_mu_);
    try {
        engine_ = factory_(options_);
    } catch (const std::exception& e) {
        throw std::runtime_error(fmt::format("the engine did not start: {}", e.what()));
    }
    if (!engine_) throw std::runtime_error("the engine did not start");
    {
        std::lock_guard lock(state_mu_);
        options_.vram_kv_bytes = engine_->options().vram_kv_bytes;  // what it took ("auto")
    }
    engine_up_ = true;
    refresh_snapshot_locked();
    const EngineStatus first = [&] {
        std::lock_guard lock(snapshot_mu_);
        return snapshot_;
    }();
    log_info("engine.started",
             "engine up: {} {} KV, mode {}, CPU kernel {}, {} attention threads, GPU {}",
             options_.geometry.name, dtype_name(options_.geometry.dtype), first.mode, first.cpu_isa,
             first.attention_threads, first.gpu ? "kernel " + first.gpu_kernel : "no");
    if (first.gpu && !first.gpu_tensor_cores)
        log_warning("engine.gpu-kernel",
                    "the GPU runs its slower attention kernel: {}; in-place attention reads "
                    "device memory at a fraction of the tensor-core kernel's rate",
                    first.gpu_kernel);

    const auto fp = fingerprint_of(machine_, options_.gpu_index, first.attention_threads);
    const CalibrationKey key{fp.text(), geometry_key(options_),
                             std::string(dtype_name(options_.geometry.dtype)), WRITESCOPE_VERSION};
    {
        std::lock_guard lock(state_mu_);
        key_ = key;
    }

    // Reuse or measure.
    std::optional<StoredCalibration> stored;
    try {
        stored = store_->latest_calibration(key);
    } catch (const StoreError& e) {
        log_warning("store.read-failed", "cannot read stored calibrations: {}", e.what());
    }
    const auto age_s = stored ? unix_s_now() - stored->created_at : 0;
    bool reuse = false;
    std::string why;
    switch (profile.policy.recalibrate) {
        case Recalibrate::always:
            why = "policy.recalibrate = \"always\"";
            break;
        case Recalibrate::never:
            reuse = stored.has_value();
            why = reuse ? "" : "no stored calibration matches this machine and model";
            break;
        case Recalibrate::automatic:
            if (!stored) {
                why = "no stored calibration matches this machine and model";
            } else if (std::chrono::seconds(age_s) > profile.policy.recalibrate_max_age) {
                why = fmt::format("the stored calibration is {} s old, past recalibrate_max_age",
                                  age_s);
            } else {
                reuse = true;
            }
            break;
    }
    if (reuse) {
        engine_->set_calibration(stored->calibration);
        {
            std::lock_guard lock(state_mu_);
            calibration_ = {true, stored->calibration, "stored", stored->created_at, stored->id};
        }
        log_info("calibration.reused",
                 "reusing calibration #{} from {} s ago: A {:.4g} s/token, B {:.4g} s/token, "
                 "delta {:.4g} s",
                 stored->id, age_s, stored->calibration.a, stored->calibration.b,
                 stored->calibration.delta);
    } else {
        log_info("calibration.needed", "calibrating: {}", why);
        run_calibration_locked("boot", &status);
    }

    // Warm start from the workload history.
    WarmStartInfo warm;
    if (!profile.policy.warm_start) {
        warm.detail = "disabled (policy.warm_start = false)";
    } else {
        std::optional<WorkloadRecord> rec;
        try {
            rec = store_->latest_workload(options_.geometry.name,
                                          dtype_name(options_.geometry.dtype));
        } catch (const StoreError& e) {
            log_warning("store.read-failed", "cannot read the workload history: {}", e.what());
        }
        if (!rec) {
            warm.detail = "no history for this model and dtype";
        } else {
            warm.key = rec->key;
            warm.updated_at = rec->updated_at;
            try {
                engine_->import_policy_state(rec->policy_state);
                warm.applied = true;
                warm.detail = fmt::format("from the history of batch {} / context {}",
                                          rec->key.batch_bucket, rec->key.context_bucket);
                log_info("history.warm-start",
                         "policy warm-started from workload {} {} batch {} context {} "
                         "(updated {} s ago, {} steps)",
                         rec->key.model, rec->key.dtype, rec->key.batch_bucket,
                         rec->key.context_bucket, unix_s_now() - rec->updated_at, rec->steps);
            } catch (const std::exception& e) {
                warm.detail = fmt::format("the stored policy state was refused: {}", e.what());
                log_warning("history.warm-start-failed",
                            "cannot warm-start from the stored history: {}", e.what());
            }
        }
    }
    refresh_snapshot_locked();
    engine_lock.unlock();
    {
        std::lock_guard lock(state_mu_);
        warm_ = std::move(warm);
    }
    if (cancel_) throw std::runtime_error("stopped during boot");
    if (model_factory_) load_model(profile, status);
    {
        std::lock_guard lock(state_mu_);
        stage_ = "ready";
    }
    Phase expected = Phase::starting;
    if (!phase_.compare_exchange_strong(expected, Phase::ready))
        throw std::runtime_error("stopped during boot");
}

void Service::load_model(const Profile& profile, const StatusFn& status) {
    set_stage(status, fmt::format("loading the model {}", profile.model.source));
    std::unique_ptr<ModelHost> host;
    try {
        const ExpertHistory history = [this](std::string_view key) -> model::ExpertHeat {
            Store* s = store();
            try {
                return s ? s->expert_heat(key) : model::ExpertHeat{};
            } catch (const StoreError& e) {
                log_warning("store.read-failed", "routing history not read: {}", e.what());
                return {};
            }
        };
        host =
            model_factory_(profile, profile_source_, *engine_, history,
                           [&](std::string_view stage) { set_stage(status, std::string(stage)); });
    } catch (const std::exception& e) {
        throw std::runtime_error(e.what());
    }
    if (!host || !host->model || !host->runtime || !host->scheduler)
        throw std::runtime_error("the model runtime did not start");
    ModelInfo info;
    const auto& m = *host->model;
    const auto& c = m.config();
    info.loaded = true;
    info.name = c.name;
    info.description = m.description();
    info.model_type = c.model_type;
    info.dtype = std::string(dtype_name(c.dtype));
    info.builtin = m.builtin();
    info.layers = c.num_layers;
    info.full_layers = m.full_layers();
    info.vocab_size = c.vocab_size;
    info.weight_bytes = m.weight_bytes();
    info.parameters = c.parameter_count();
    info.max_model_len = host->runtime->max_context();
    info.prefill_chunk_tokens = host->runtime->prefill_chunk_tokens();
    info.kernel = host->kernel;
    info.expert_threads = host->expert_threads;
    info.load_seconds = host->load_seconds;
    info.placement = host->placement;
    const auto& text = host->text;
    info.tokenizer = text.tokenizer != nullptr;
    info.chat_template = text.chat_template.has_value();
    info.chat_problem = text.chat_problem;
    if (text.tokenizer) {
        const auto& tc = text.tokenizer->config();
        info.tokenizer_path = text.tokenizer_path.string();
        info.tokenizer_vocab = text.tokenizer->vocab_size();
        info.bos_token = tc.bos_token;
        info.eos_token = tc.eos_token;
        log_info("model.tokenizer", "tokenizer {} loaded: {} tokens, bos \"{}\", eos \"{}\"; {}",
                 info.tokenizer_path, info.tokenizer_vocab, tc.bos_token, tc.eos_token,
                 info.chat_template ? "chat template compiled" : info.chat_problem);
        if (!info.chat_template)
            log_warning("model.chat_template", "/v1/chat/completions is not served: {}",
                        info.chat_problem);
    } else {
        log_info("model.tokenizer", "no tokenizer loaded ({}): the model takes token ids only",
                 info.builtin ? "a built-in model" : info.chat_problem);
    }
    log_info("model.loaded",
             "model {} loaded in {:.2f} s: {} of weights, context {} tokens, {} ({} CPU kernels, "
             "{} threads), up to {} sequences",
             info.description, info.load_seconds, format_size_human(info.weight_bytes),
             info.max_model_len,
             info.placement.gpu ? fmt::format("on the GPU: {}", info.placement.summary)
                                : std::string("on the CPU"),
             info.kernel, info.expert_threads, host->scheduler->max_sequences());
    host->scheduler->on_fault([this](const std::string& why) {
        log_error("model.device-fault",
                  "the GPU can no longer run the model ({}): the requests in flight failed, new "
                  "ones are refused; stopping so that the service manager starts writescoped "
                  "again",
                  why);
        if (fault_fn_) fault_fn_(why);
    });
    std::lock_guard lock(model_mu_);
    model_ = std::move(host);
    model_info_ = std::move(info);
}

std::optional<Service::StepStall> Service::stalled_step() const {
    const auto limit = profile().server.step_timeout;
    const model::Scheduler* s = limit.count() > 0 ? scheduler() : nullptr;
    if (!s) return std::nullopt;
    const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(s->step_running());
    if (ran <= limit) return std::nullopt;
    return StepStall{ran, limit};
}

model::Scheduler* Service::scheduler() const {
    std::lock_guard lock(model_mu_);
    return model_ ? model_->scheduler.get() : nullptr;
}

const ModelText* Service::text() const {
    std::lock_guard lock(model_mu_);
    return model_ ? &model_->text : nullptr;
}

void Service::cancel_generation() {
    if (auto* s = scheduler()) s->shutdown();
}

void Service::run_calibration_locked(const std::string& trigger, const StatusFn* status) {
    {
        std::lock_guard lock(job_mu_);
        job_ = {"running", trigger, 0, "starting", unix_ms_now(), 0, {}};
    }
    int last_percent = -1;
    std::string last_stage;
    auto progress = [&](double fraction, std::string_view stage) {
        fraction = std::clamp(std::isfinite(fraction) ? fraction : 0.0, 0.0, 1.0);
        {
            std::lock_guard lock(job_mu_);
            job_.progress = fraction;
            job_.stage = std::string(stage);
        }
        const int percent = static_cast<int>(fraction * 100);
        if (status && *status && (percent != last_percent || stage != last_stage)) {
            last_percent = percent;
            last_stage = std::string(stage);
            set_stage(*status, fmt::format("calibrating: {}% ({})", percent, stage));
        }
    };
    const auto t0 = std::chrono::steady_clock::now();
    Calibration c;
    try {
        c = engine_->calibrate(progress, &cancel_);
    } catch (const std::exception& e) {
        const bool cancelled = cancel_.load();
        std::lock_guard lock(job_mu_);
        job_.state = cancelled ? "cancelled" : "failed";
        job_.error = e.what();
        job_.finished_at_ms = unix_ms_now();
        if (trigger == "boot")
            throw std::runtime_error(cancelled ? std::string("calibration cancelled")
                                               : fmt::format("calibration failed: {}", e.what()));
        throw;
    }
    if (c.seconds_taken <= 0)
        c.seconds_taken =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    engine_->set_calibration(c);
    const auto created = unix_s_now();
    std::int64_t id = 0;
    try {
        id = store_->save_calibration(key_, c, created);
    } catch (const StoreError& e) {
        log_warning("store.write-failed", "calibration not saved: {}", e.what());
    }
    {
        std::lock_guard lock(state_mu_);
        calibration_ = {true, c, "measured", created, id};
    }
    log_info("calibration.done",
             "calibrated in {:.2f} s: A {:.4g} s/token (R² {:.3f}), B {:.4g} s/token (R² {:.3f}), "
             "delta {:.4g} s, {} points{}",
             c.seconds_taken, c.a, c.a_r2, c.b, c.b_r2, c.delta, c.points.size(),
             c.has_gpu ? "" : ", no GPU");
    refresh_snapshot_locked();
    std::lock_guard lock(job_mu_);
    job_.progress = 1;
    job_.stage = "done";
    job_.state = "done";
    job_.finished_at_ms = unix_ms_now();
}

Service::Result Service::start_calibration() {
    if (phase_ != Phase::ready) return {Outcome::busy, unavailable_message()};
    std::lock_guard lock(job_mu_);
    if (job_.state == "running")
        return {Outcome::busy,
                fmt::format("a calibration is already running ({:.0f}%)", job_.progress * 100)};
    // The previous job's last act was to set its final state under job_mu_, so it is done.
    if (job_thread_.joinable()) job_thread_.join();
    job_ = {"running", "api", 0, "waiting for the engine", unix_ms_now(), 0, {}};
    job_thread_ = std::thread([this] {
        std::unique_lock engine_lock(engine_mu_);
        // The engine calibrates alone: the scheduler holds between steps meanwhile (its
        // requests wait, none fails).
        model::Scheduler* sched = scheduler();
        if (sched) sched->pause();
        struct Resume {
            model::Scheduler* s;
            ~Resume() {
                if (s) s->resume();
            }
        } resume{sched};
        try {
            run_calibration_locked("api", nullptr);
        } catch (const std::exception& e) {
            log_warning("calibration.failed", "recalibration {}: {}",
                        cancel_ ? "cancelled" : "failed", e.what());
        }
        apply_pending_policy_locked();
        refresh_snapshot_locked();
    });
    log_info("calibration.started", "recalibration requested through the API");
    return {Outcome::ok, "calibration started"};
}

void Service::request_stop() {
    Phase p = phase_.load();
    while (p != Phase::stopping && !phase_.compare_exchange_weak(p, Phase::stopping)) {
    }
    cancel_ = true;
    if (auto* s = scheduler()) s->stop_accepting();
}

void Service::finish() {
    std::call_once(finished_, [this] {
        request_stop();
        {
            // A job thread that was started is joined here; none can start any more.
            std::unique_lock lock(job_mu_);
            auto t = std::move(job_thread_);
            lock.unlock();
            if (t.joinable()) t.join();
        }
        cancel_generation();
        persist_history(true);
    });
}

void Service::refresh_snapshot_locked() const {
    if (!engine_) return;
    EngineStatus s;
    try {
        s = engine_->status();
    } catch (const std::exception& e) {
        log_warning("engine.status-failed", "engine status failed: {}", e.what());
        return;
    }
    std::lock_guard lock(snapshot_mu_);
    snapshot_ = std::move(s);
}

ServiceView Service::view() const {
    ServiceView v;
    v.phase = phase_.load();
    v.started_at_ms = started_at_ms_;
    v.uptime_seconds = static_cast<double>(unix_ms_now() - started_at_ms_) / 1000.0;
    v.version = WRITESCOPE_VERSION;
    v.allocator = allocator_;
    v.profile_source = profile_source_;
    v.engine_up = engine_up_.load();
    if (v.engine_up) {
        std::unique_lock engine_lock(engine_mu_, std::try_to_lock);
        if (engine_lock.owns_lock())
            refresh_snapshot_locked();
        else
            v.engine_busy = true;
        std::lock_guard lock(snapshot_mu_);
        v.engine = snapshot_;
    }
    {
        std::lock_guard lock(state_mu_);
        v.engine_options = options_;
        v.gpu_unused = gpu_unused_reason(profile_, machine_, options_);
        v.kv_auto = kv_auto_;
        v.profile = profile_;
        v.boot_stage = stage_;
        v.calibration_key = key_;
        v.calibration = calibration_;
        v.warm_start = warm_;
        if (store_) {
            v.store = store_->report();
            v.store_writes = store_->write_health();
        }
    }
    {
        std::lock_guard lock(job_mu_);
        v.job = job_;
    }
    {
        std::lock_guard lock(requests_mu_);
        for (const auto& [k, n] : requests_)
            v.requests.push_back({k.first, k.second, n});
    }
    {
        std::lock_guard lock(model_mu_);
        v.model = model_info_;
        if (model_) v.scheduler = model_->scheduler->stats();
    }
    return v;
}

Profile Service::profile() const {
    std::lock_guard lock(state_mu_);
    return profile_;
}

std::string Service::unavailable_message() const {
    switch (phase_.load()) {
        case Phase::starting: {
            std::lock_guard lock(state_mu_);
            return fmt::format("writescoped is starting: {}", stage_);
        }
        case Phase::stopping:
            return "writescoped is stopping";
        case Phase::ready:
            break;
    }
    return "writescoped is ready";
}

Service::Result Service::change_policy(const PolicyChange& change) {
    if (change.mode)
        if (auto e = validate_mode(*change.mode); !e.empty()) return {Outcome::invalid, e};
    if (change.tracker_alpha && !(std::isfinite(*change.tracker_alpha) &&
                                  *change.tracker_alpha > 0 && *change.tracker_alpha <= 1))
        return {Outcome::invalid, "tracker.alpha must be in (0, 1]"};
    if (change.tracker_clamp &&
        !(std::isfinite(*change.tracker_clamp) && *change.tracker_clamp >= 1))
        return {Outcome::invalid, "tracker.clamp must be at least 1"};
    if (phase_ != Phase::ready) return {Outcome::busy, unavailable_message()};

    // Never waited for: this runs on the serving thread, and only a calibration (seconds) holds
    // the engine for more than a moment.
    std::unique_lock engine_lock(engine_mu_, std::try_to_lock);
    if (!engine_lock.owns_lock())
        return {Outcome::busy, "a calibration holds the engine; retry when it has finished"};
    Profile p = profile();
    const std::string old_mode = p.policy.mode;
    try {
        if (change.mode) engine_->set_mode(*change.mode);
        if (change.tracker_alpha || change.tracker_clamp)
            engine_->set_tracker(change.tracker_alpha.value_or(p.policy.tracker_alpha),
                                 change.tracker_clamp.value_or(p.policy.tracker_clamp));
    } catch (const std::invalid_argument& e) {
        if (change.mode) {
            try {
                engine_->set_mode(old_mode);
            } catch (const std::exception&) {
            }
        }
        return {Outcome::invalid, e.what()};
    }
    if (change.mode) p.policy.mode = *change.mode;
    if (change.tracker_alpha) p.policy.tracker_alpha = *change.tracker_alpha;
    if (change.tracker_clamp) p.policy.tracker_clamp = *change.tracker_clamp;
    refresh_snapshot_locked();
    engine_lock.unlock();
    {
        std::lock_guard lock(state_mu_);
        profile_.policy = p.policy;
        pending_policy_.reset();
    }
    log_info("policy.changed", "policy set through the API: mode {}, tracker alpha {} clamp {}",
             p.policy.mode, p.policy.tracker_alpha, p.policy.tracker_clamp);
    return {Outcome::ok, {}};
}

void Service::apply_pending_policy_locked() {
    std::optional<PendingPolicy> pending;
    {
        std::lock_guard lock(state_mu_);
        pending.swap(pending_policy_);
    }
    if (!pending || !engine_) return;
    try {
        engine_->set_mode(pending->mode);
        engine_->set_tracker(pending->alpha, pending->clamp);
        log_info("reload.policy-applied", "reloaded policy applied after the calibration: mode {}",
                 pending->mode);
    } catch (const std::exception& e) {
        log_error("reload.policy-failed", "the reloaded policy was refused by the engine: {}",
                  e.what());
    }
}

Service::ReloadResult Service::reload(const Profile& next, std::string_view source) {
    ReloadResult r;
    const Profile running = profile();
    Profile merged;
    try {
        merged = merge_reloadable(running, next, &r.needs_restart);
    } catch (const std::exception& e) {
        r.error = e.what();
        return r;
    }
    // The file must be one startup would take, and the new values of reloadable keys must hold
    // with the running values of the others: policy.mode is the one reloadable key that depends
    // on a restart-only one (a GPU mode needs the running daemon to have a GPU, not the file).
    // The running values themselves were checked at startup; they are not checked again (a
    // model directory moved since would otherwise refuse a policy-only reload).
    engine_options_from_profile(next, machine_, source);
    try {
        check_mode_gpu(merged, options_.gpu_index, source);
    } catch (const ProfileError& e) {
        std::vector<ProfileIssue> issues = e.issues();
        for (auto& i : issues)
            i.message += fmt::format(
                " (as it would run: {} keep{} the running value{} until a "
                "restart)",
                fmt::join(r.needs_restart, ", "), r.needs_restart.size() == 1 ? "s" : "",
                r.needs_restart.size() == 1 ? "" : "s");
        throw ProfileError(e.source(), std::move(issues));
    }
    r.applied = changed_keys(running, merged);
    const auto& np = merged.policy;
    const auto& op = running.policy;
    const bool policy_changed = np.mode != op.mode || np.tracker_alpha != op.tracker_alpha ||
                                np.tracker_clamp != op.tracker_clamp;
    if (policy_changed && engine_up_) {
        // Not waited for (the serving thread): a busy engine takes the policy after the
        // calibration (pending_policy_).
        std::unique_lock engine_lock(engine_mu_, std::try_to_lock);
        if (engine_lock.owns_lock()) {
            try {
                engine_->set_mode(np.mode);
                engine_->set_tracker(np.tracker_alpha, np.tracker_clamp);
            } catch (const std::exception& e) {
                try {
                    engine_->set_mode(op.mode);
                    engine_->set_tracker(op.tracker_alpha, op.tracker_clamp);
                } catch (const std::exception&) {
                }
                r.error =
                    fmt::format("policy.mode: the engine refused \"{}\": {}", np.mode, e.what());
                r.applied.clear();
                return r;
            }
            refresh_snapshot_locked();
        } else {
            r.policy_deferred = true;
        }
    }
    {
        std::lock_guard lock(state_mu_);
        profile_ = merged;
        if (r.policy_deferred)
            pending_policy_ = PendingPolicy{np.mode, np.tracker_alpha, np.tracker_clamp};
    }
    r.ok = true;
    return r;
}

Store* Service::store() const {
    // Set once by boot(), never replaced: the lock covers reading the pointer, not the SQLite
    // work (the Store serialises that itself), so a busy database file never holds state_mu_.
    std::lock_guard lock(state_mu_);
    return store_.get();
}

std::vector<WorkloadRecord> Service::history() const {
    Store* s = store();
    return s ? s->workloads() : std::vector<WorkloadRecord>{};
}

Service::KvHistory Service::kv_history() const {
    KvHistory h;
    {
        std::lock_guard lock(state_mu_);
        h.model = options_.geometry.name;
        h.dtype = dtype_name(options_.geometry.dtype);
    }
    if (Store* s = store()) h.demand = s->kv_demand(h.model, h.dtype);
    return h;
}

std::vector<Sample> Service::samples(std::size_t limit) const {
    Store* s = store();
    return s ? s->samples(limit) : std::vector<Sample>{};
}

void Service::take_sample() {
    if (!engine_up_ || phase_ != Phase::ready) return;
    std::unique_lock engine_lock(engine_mu_, std::try_to_lock);
    if (!engine_lock.owns_lock()) return;
    refresh_snapshot_locked();
    engine_lock.unlock();
    Sample x;
    {
        std::lock_guard lock(snapshot_mu_);
        x.at_ms = unix_ms_now();
        x.steps = snapshot_.steps;
        x.sequences = snapshot_.sequences;
        x.a = snapshot_.a;
        x.b = snapshot_.b;
        x.delta = snapshot_.delta;
        x.r_target = snapshot_.r_target;
        x.r_deployed = snapshot_.r_deployed;
        x.step_seconds_mean = snapshot_.step_seconds_mean;
    }
    const std::size_t keep = profile().storage.sample_log_max;
    try {
        if (Store* s = store()) s->append_sample(x, keep);
    } catch (const StoreError& e) {
        log_warning("store.write-failed", "sample not written: {}", e.what());
    }
}

WorkloadRecord Service::workload_record_locked() const {
    const EngineStatus s = engine_->status();
    return workload_record_of(engine_->export_policy_state(), s);
}

// The routing counted since the last write (the scheduler's counts since start, less what was
// written), added to the model's stored history.
void Service::persist_expert_heat() {
    Store* store_now = store();
    if (!store_now) return;
    std::lock_guard heat_lock(heat_mu_);
    model::ExpertHeat total;
    std::string key;
    {
        std::lock_guard lock(model_mu_);
        if (!model_) return;
        total = model_->scheduler->stats().expert_heat;
        key = model_->heat_key;
    }
    model::ExpertHeat delta = total;
    bool any = false;
    for (std::size_t l = 0; l < delta.counts.size(); ++l)
        for (std::size_t e = 0; e < delta.counts[l].size(); ++e) {
            const std::uint64_t saved =
                l < heat_saved_.counts.size() && e < heat_saved_.counts[l].size()
                    ? heat_saved_.counts[l][e]
                    : 0;
            delta.counts[l][e] -= std::min(saved, delta.counts[l][e]);
            any |= delta.counts[l][e] != 0;
        }
    if (!any) return;
    try {
        store_now->add_expert_heat(key, delta, unix_ms_now() / 1000);
        heat_saved_ = std::move(total);
    } catch (const StoreError& e) {
        log_warning("store.write-failed", "routing history not written: {}", e.what());
    }
}

// The decode steps counted since the last write, added to the stored KV demand of the engine's
// KV model and dtype (what "auto" sizes G by at the next start).
void Service::persist_kv_demand() {
    Store* store_now = store();
    if (!store_now) return;
    std::lock_guard heat_lock(heat_mu_);
    model::KvDemand total;
    {
        std::lock_guard lock(model_mu_);
        if (!model_) return;
        total = model_->scheduler->stats().kv_demand;
    }
    const model::KvDemand delta = total.since(kv_saved_);
    if (delta.empty()) return;
    try {
        store_now->add_kv_demand(options_.geometry.name, dtype_name(options_.geometry.dtype), delta,
                                 unix_ms_now() / 1000);
        kv_saved_ = std::move(total);
    } catch (const StoreError& e) {
        log_warning("store.write-failed", "KV history not written: {}", e.what());
    }
}

void Service::persist_history(bool wait) {
    persist_expert_heat();
    persist_kv_demand();
    if (!engine_up_) return;
    // Until boot has finished, the engine's state is not a workload's history yet.
    if (!wait && phase_ != Phase::ready) return;
    {
        std::lock_guard lock(state_mu_);
        if (!store_ || calibration_.present == false) return;
    }
    std::unique_lock engine_lock(engine_mu_, std::defer_lock);
    if (wait)
        engine_lock.lock();
    else if (!engine_lock.try_lock())  // the serving thread's timer: the next tick writes it
        return;
    WorkloadRecord r;
    try {
        r = workload_record_locked();
    } catch (const std::exception& e) {
        log_warning("history.export-failed", "cannot export the policy state: {}", e.what());
        return;
    }
    engine_lock.unlock();
    try {
        store()->put_workload(r);
    } catch (const StoreError& e) {
        log_warning("store.write-failed", "history not written: {}", e.what());
        return;
    }
    log_debug("history.written", "history of {} {} batch {} context {} written ({} steps)",
              r.key.model, r.key.dtype, r.key.batch_bucket, r.key.context_bucket, r.steps);
}

void Service::count_request(std::string_view route, int status) {
    std::lock_guard lock(requests_mu_);
    ++requests_[{std::string(route), status}];
}

}  // namespace writescope::daemon
