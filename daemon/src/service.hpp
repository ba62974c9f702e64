// The daemon's state and behaviour, apart from any event loop: boot (store → engine → calibrate
// or reuse → warm start), runtime changes (policy, recalibration, reload), persistence (history,
// samples) and a consistent view of it all for the API.
//
// Threads: the serving loop calls everything but boot(); boot() runs on its own thread; an API
// recalibration runs on a job thread. Engine calls are serialised by one mutex, which a
// calibration holds for its whole run: readers then get the last status snapshot instead of
// waiting (ServiceView::engine_busy says so).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "auto_kv.hpp"
#include "engine_host.hpp"
#include "machine.hpp"
#include "model_host.hpp"
#include "profile.hpp"
#include "store.hpp"
#include "writescope/core/engine.hpp"

namespace writescope::daemon {

enum class Phase : std::uint8_t { starting, ready, stopping };
std::string_view phase_name(Phase p) noexcept;

struct AllocatorInfo {
    std::string name = "libc";
    std::string version;
    bool overrides_malloc = false;  // malloc() itself returns the allocator's memory
};

// The calibration the policy runs on.
struct CalibrationInfo {
    bool present = false;
    Calibration calibration;
    std::string source;           // "measured" (by this process) or "stored" (reused)
    std::int64_t created_at = 0;  // unix seconds
    std::int64_t store_id = 0;    // its row in the store; 0 when it could not be saved
};

// The latest calibration run (at boot or from POST /v1/calibration).
struct CalibrationJobInfo {
    std::string state = "idle";  // idle | running | done | failed | cancelled
    std::string trigger;         // boot | api
    double progress = 0;         // in [0, 1]
    std::string stage;
    std::int64_t started_at_ms = 0, finished_at_ms = 0;  // unix milliseconds
    std::string error;
};

struct WarmStartInfo {
    bool applied = false;
    std::string detail;  // why not, or what was imported
    HistoryKey key;
    std::int64_t updated_at = 0;
};

struct RequestCount {
    std::string route;
    int status = 0;
    std::uint64_t count = 0;
};

// The model being served (ServiceView::model).
struct ModelInfo {
    bool loaded = false;
    std::string name;         // the preset's or the directory's name: the API's model id
    std::string description;  // Model::description(): what was loaded and how it was cut
    std::string model_type, dtype;
    bool builtin = false;
    int layers = 0, full_layers = 0;
    int vocab_size = 0;
    std::uint64_t weight_bytes = 0, parameters = 0;
    std::size_t max_model_len = 0;  // the context: prompt + completion tokens
    std::size_t prefill_chunk_tokens = 0;
    std::string kernel;  // the CPU expert/GEMM kernels
    int expert_threads = 0;
    double load_seconds = 0;
    ModelPlacement placement;  // GPU or CPU, and what the GPU holds
    // The text side (ModelText): the tokenizer.json read ("" when none) and whether a chat
    // template serves /v1/chat/completions, else why not.
    bool tokenizer = false;
    std::string tokenizer_path;
    std::size_t tokenizer_vocab = 0;
    std::string bos_token, eos_token;
    bool chat_template = false;
    std::string chat_problem;
};

// Everything the API reports, taken at one moment.
struct ServiceView {
    Phase phase = Phase::starting;
    std::string boot_stage;
    double uptime_seconds = 0;
    std::int64_t started_at_ms = 0;
    std::string version;
    Profile profile;
    std::string profile_source;
    EngineOptions engine_options;
    // Why hardware.gpu "auto" left this machine's GPU unused (gpu_unused_reason); empty when the
    // GPU is used, or there is none, or the profile names no GPU.
    std::string gpu_unused;
    bool engine_up = false;
    bool engine_busy = false;  // a calibration holds the engine: `engine` is the last snapshot
    EngineStatus engine;
    CalibrationKey calibration_key;
    CalibrationInfo calibration;
    CalibrationJobInfo job;
    WarmStartInfo warm_start;
    std::optional<AutoKv> kv_auto;  // hardware.vram_kv_budget "auto" with a GPU
    StoreOpenReport store;
    StoreWriteHealth store_writes;
    AllocatorInfo allocator;
    std::vector<RequestCount> requests;
    ModelInfo model;
    std::optional<model::SchedulerStats> scheduler;  // once the model serves
};

class Service {
  public:
    using StatusFn = std::function<void(std::string_view status)>;

    // model_factory: builds the model, its runtime and the scheduler at the end of boot; none
    // (the daemon's unit tests): no model, and /v1/completions answers 503.
    Service(Profile profile, std::string profile_source, EngineOptions options, MachineInfo machine,
            EngineFactory factory, AllocatorInfo allocator, ModelFactory model_factory = {});
    ~Service();
    Service(const Service&) = delete;
    Service& operator=(const Service&) = delete;

    // Opens the store, builds the engine, calibrates or reuses a stored calibration, warm-starts
    // the policy, loads the model and starts its scheduler, then enters Phase::ready. status() is
    // told each stage (for STATUS=). Throws std::runtime_error on a failure that leaves the daemon
    // unable to serve (and when request_stop() cancels it).
    void boot(const StatusFn& status);
    // Called (once, on the scheduler's thread) when the model's device can no longer run steps
    // (model::Scheduler::on_fault, after a failed step: a sticky GPU error); the daemon stops on
    // it, with a failure status, so that its service manager starts it again. Set before boot.
    using FaultFn = std::function<void(const std::string& why)>;
    void on_device_fault(FaultFn fn) { fault_fn_ = std::move(fn); }

    Phase phase() const noexcept { return phase_.load(); }
    // Stops new work: the phase becomes stopping, a running calibration is cancelled, and the
    // scheduler takes no new requests (those admitted or queued go on: the drain).
    void request_stop();
    // Ends the drain: the requests still queued or running are cancelled.
    void cancel_generation();
    // After request_stop(): stops the scheduler (cancelling what is left), waits for the
    // calibration job, then persists the history (once).
    void finish();

    // The scheduler of the loaded model; null until boot has loaded it (and in the unit tests'
    // services built without a model factory). Valid until the Service is destroyed.
    model::Scheduler* scheduler() const;
    // The loaded model's tokenizer and chat template; null until boot has loaded the model.
    // Valid (and immutable) until the Service is destroyed.
    const ModelText* text() const;

    ServiceView view() const;
    Profile profile() const;
    // How long the scheduler's step has run, when that is longer than server.step_timeout (a
    // hung GPU or CPU: the daemon then stops answering the watchdog), with that limit; nothing
    // otherwise.
    struct StepStall {
        std::chrono::milliseconds ran, limit;
    };
    std::optional<StepStall> stalled_step() const;
    // What a 503 says while starting or stopping.
    std::string unavailable_message() const;

    enum class Outcome : std::uint8_t { ok, invalid, busy };
    struct Result {
        Outcome outcome = Outcome::ok;
        std::string message;
    };

    struct PolicyChange {
        std::optional<std::string> mode;
        std::optional<double> tracker_alpha;
        std::optional<double> tracker_clamp;
    };
    Result change_policy(const PolicyChange& change);

    // Starts a recalibration on a job thread (busy when one runs).
    Result start_calibration();

    struct ReloadResult {
        bool ok = false;
        std::string error;                       // why the new profile was not taken
        std::vector<std::string> applied;        // reloadable keys that changed
        std::vector<std::string> needs_restart;  // changed keys that wait for a restart
        bool policy_deferred = false;            // engine busy: applied when calibration ends
    };
    // `next` is the profile as loaded (load_effective_profile), `source` its file. It is checked
    // as startup checks it (engine_options_from_profile on this machine), and the profile that
    // would run (`next` with the restart-only keys at their running values) where a reloadable
    // key depends on a restart-only one: policy.mode against the running GPU (check_mode_gpu).
    // A problem throws ProfileError naming the key; nothing is applied.
    ReloadResult reload(const Profile& next, std::string_view source);

    std::vector<WorkloadRecord> history() const;
    // The stored KV demand of the engine's KV model and dtype (what "auto" sizes G by at the next
    // start; the steps since the last history write are not in it yet).
    struct KvHistory {
        std::string model, dtype;
        model::KvDemand demand;
    };
    KvHistory kv_history() const;
    std::vector<Sample> samples(std::size_t limit) const;
    // Appends the engine's state to the sample log (skips when the engine is busy).
    void take_sample();
    // Writes the current workload's history row. wait: block for the engine (shutdown).
    void persist_history(bool wait);

    void count_request(std::string_view route, int status);

  private:
    struct PendingPolicy {
        std::string mode;
        double alpha = 0, clamp = 0;
    };

    void set_stage(const StatusFn& status, std::string stage);
    void load_model(const Profile& profile, const StatusFn& status);
    // With engine_mu_ held.
    void refresh_snapshot_locked() const;
    void run_calibration_locked(const std::string& trigger, const StatusFn* status);
    void apply_pending_policy_locked();
    WorkloadRecord workload_record_locked() const;

    const std::string profile_source_;
    // Written by boot() alone (hardware.vram_kv_budget "auto", then the VRAM the engine took),
    // under state_mu_; read by others under it.
    EngineOptions options_;
    const MachineInfo machine_;
    const EngineFactory factory_;
    const AllocatorInfo allocator_;
    const ModelFactory model_factory_;
    const std::int64_t started_at_ms_;
    FaultFn fault_fn_;  // set before boot, read on the scheduler's thread

    std::atomic<Phase> phase_{Phase::starting};
    std::atomic<bool> cancel_{false};

    Store* store() const;  // the store boot() opened, or null before it; not under state_mu_
    void persist_expert_heat();
    void persist_kv_demand();
    std::mutex heat_mu_;            // heat_saved_, kv_saved_, and one history write at a time
    model::ExpertHeat heat_saved_;  // the scheduler's counts already in the store
    model::KvDemand kv_saved_;      // likewise
    mutable std::mutex state_mu_;   // profile_, stage_, calibration_, warm_, key_, store_ pointer
    Profile profile_;
    std::string stage_ = "starting";
    CalibrationKey key_;
    CalibrationInfo calibration_;
    WarmStartInfo warm_;
    std::optional<AutoKv> kv_auto_;  // hardware.vram_kv_budget "auto" with a GPU: the decision
    std::unique_ptr<Store> store_;
    std::optional<PendingPolicy> pending_policy_;

    // Every call into engine_. The serving thread only ever tries it (never waits): a
    // calibration holds it for seconds.
    mutable std::timed_mutex engine_mu_;
    std::unique_ptr<Engine> engine_;
    std::atomic<bool> engine_up_{false};

    // After engine_, so it is destroyed first (the runtime holds the engine). Set once by boot()
    // under model_mu_, never replaced.
    mutable std::mutex model_mu_;
    std::unique_ptr<ModelHost> model_;
    ModelInfo model_info_;

    mutable std::mutex snapshot_mu_;
    mutable EngineStatus snapshot_;

    mutable std::mutex job_mu_;
    CalibrationJobInfo job_;
    std::thread job_thread_;

    mutable std::mutex requests_mu_;
    std::map<std::pair<std::string, int>, std::uint64_t> requests_;

    std::once_flag finished_;
};

// Text of the KV geometry for a calibration key: name, shape and block size.
std::string geometry_key(const EngineOptions& o);
// The history row of an exported policy state (text version 1, docs/policy.md): its workload
// key, constants and step statistics come from the text itself, so the store and the policy
// always agree on the bucketing. Throws std::invalid_argument naming the bad line.
WorkloadRecord workload_record_of(std::string_view policy_state, const EngineStatus& s);

std::int64_t unix_ms_now();

}  // namespace writescope::daemon
