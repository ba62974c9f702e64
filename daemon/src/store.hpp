// The daemon's persistent state: one SQLite database (WAL) in the state directory.
//
//   calibrations      the roofline constants measured at boot, keyed by the hardware fingerprint,
//                     the KV geometry, the dtype and the software version; newest row wins
//   workload_history  per workload (model, dtype, batch bucket, context bucket): the tracked A
//                     and B, the deployed r, step statistics and the engine's policy state text
//   samples           a bounded log of the engine's state over time (the newest N rows)
//   expert_heat       per served model: the tokens routed to each expert of each layer, summed
//                     over runs (the GPU placement's routing history)
//   kv_demand         per KV model and dtype: decode steps by the KV tokens they held, summed
//                     over runs (what hardware.vram_kv_budget "auto" sizes G by)
//
// The schema is versioned (PRAGMA user_version) and migrated forward at open. A database that
// cannot be opened, fails its integrity check, has a schema version this release does not know
// (newer, or negative) or tables whose columns are not the schema's is moved aside
// (writescope.db.bad-<UTC time>, with its -wal and -shm) and a fresh one is created; if even that
// fails the store lives in memory for this run. Opening never throws.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "writescope/core/engine.hpp"
#include "writescope/core/model/kv_demand.hpp"
#include "writescope/core/model/placement.hpp"

struct sqlite3;

namespace writescope::daemon {

// A failed read or write after a successful open (disk full, I/O error): the caller logs it and
// carries on without persistence for that operation.
class StoreError : public std::runtime_error {
  public:
    explicit StoreError(const std::string& what, int sqlite_code = 0)
        : std::runtime_error(what), code_(sqlite_code) {}
    int sqlite_code() const noexcept { return code_; }  // extended result code; 0 if none

  private:
    int code_;
};

struct CalibrationKey {
    std::string fingerprint;       // HardwareFingerprint::text()
    std::string geometry;          // KV geometry name and shape, and the block size
    std::string dtype;             // "bf16"
    std::string software_version;  // the project version
    friend bool operator==(const CalibrationKey&, const CalibrationKey&) = default;
};

struct StoredCalibration {
    std::int64_t id = 0;
    CalibrationKey key;
    Calibration calibration;      // A, B, Δ (s/token/layer, s), fit quality, points
    std::int64_t created_at = 0;  // unix seconds
};

// A workload as the policy buckets it (docs/policy.md section 5): the key of a history row.
struct HistoryKey {
    std::string model;
    std::string dtype;
    std::int64_t batch_bucket = 1;       // sequences per step, rounded up to a power of two
    std::int64_t context_bucket = 1024;  // context tokens per sequence, power of two, >= 1024
    friend bool operator==(const HistoryKey&, const HistoryKey&) = default;
};

struct WorkloadRecord {
    HistoryKey key;
    double a = 0, b = 0, delta = 0;  // tracked constants (s/token/layer, s/layer/step)
    double r_target = 1, r_deployed = 1;
    // Step times per layer, seconds, over `steps` decode steps.
    std::uint64_t steps = 0;
    double step_seconds_mean = 0, step_seconds_stddev = 0;
    double step_seconds_min = 0, step_seconds_max = 0;
    std::string policy_state;     // Engine::export_policy_state(), text version 1
    std::int64_t updated_at = 0;  // unix seconds
};

struct Sample {
    std::int64_t at_ms = 0;  // unix milliseconds
    std::uint64_t steps = 0;
    std::uint64_t sequences = 0;
    double a = 0, b = 0, delta = 0;
    double r_target = 1, r_deployed = 1;
    double step_seconds_mean = 0;
};

// What happened at open, for the boot log and /v1/status.
struct StoreOpenReport {
    std::filesystem::path path;  // the database file (empty when in memory)
    bool created = false;        // a new database was made
    bool in_memory = false;      // nothing could be opened on disk: nothing persists
    std::string moved_aside_to;  // where a bad database went (empty if none)
    std::string problem;         // why it was moved aside / why in memory
    int schema_version = 0;
    int migrated_from = -1;  // the version migrated from; -1 when no migration ran
};

// Writes that failed since the store opened (a read-only file, a full disk): for /v1/status, the
// metrics and the log (store.write-failed).
struct StoreWriteHealth {
    std::uint64_t write_failures = 0;
    std::string last_write_error;              // empty when none failed
    std::int64_t last_write_failed_at_ms = 0;  // unix milliseconds; 0 when none failed
};

class Store {
  public:
    static constexpr int kSchemaVersion = 3;
    static constexpr std::string_view kFileName = "writescope.db";
    // How long a lock held by another process (sqlite3, a second daemon) is waited for: at open
    // and by every read and write after it.
    static constexpr std::chrono::milliseconds kLockWait{10000};
    static constexpr long long lock_wait_seconds() {
        return std::chrono::duration_cast<std::chrono::seconds>(kLockWait).count();
    }

    // Called at most once by open(), when the database file is locked by another process and
    // open() starts to wait for it (kLockWait at most; logged as store.waiting).
    using LockWait = std::function<void()>;
    static std::unique_ptr<Store> open(const std::filesystem::path& state_dir,
                                       const LockWait& on_lock_wait = {});
    // A store in memory only (tests, and the fallback).
    static std::unique_ptr<Store> open_in_memory();
    ~Store();
    Store(const Store&) = delete;
    Store& operator=(const Store&) = delete;

    const StoreOpenReport& report() const noexcept { return report_; }
    StoreWriteHealth write_health() const;

    // The newest calibration with exactly this key.
    std::optional<StoredCalibration> latest_calibration(const CalibrationKey& key) const;
    std::int64_t save_calibration(const CalibrationKey& key, const Calibration& c,
                                  std::int64_t created_at);
    // Newest first.
    std::vector<StoredCalibration> calibrations(std::size_t limit) const;

    // Inserts or replaces the row of r.key.
    void put_workload(const WorkloadRecord& r);
    // Newest update first.
    std::vector<WorkloadRecord> workloads() const;
    std::optional<WorkloadRecord> latest_workload(std::string_view model,
                                                  std::string_view dtype) const;

    // Appends a sample and drops all but the newest `keep` rows.
    void append_sample(const Sample& s, std::size_t keep);
    // Newest first.
    std::vector<Sample> samples(std::size_t limit) const;
    std::size_t sample_count() const;

    // Adds the counts of `delta` to the model's stored routing history. When the model's tokens
    // routed then pass `keep_tokens`, every count of the model is halved (rows that reach 0 go),
    // as the KV demand is: the placement follows a workload that changes, weighting the newest
    // ~keep_tokens routings (Qwen3-30B-A3B routes 384 per token: ~10M tokens).
    static constexpr std::uint64_t kExpertHeatKeepTokens = 4'000'000'000;
    void add_expert_heat(std::string_view model, const model::ExpertHeat& delta,
                         std::int64_t updated_at,
                         std::uint64_t keep_tokens = kExpertHeatKeepTokens);
    // The model's routing history (empty when none): counts[layer][expert].
    model::ExpertHeat expert_heat(std::string_view model) const;

    // Adds `delta` to the stored decode steps of this KV model and dtype, bucket by bucket. When
    // their steps then pass `keep_steps`, every count of the model is halved (rows that reach 0
    // go): the history follows a workload that changes, weighting the newest ~keep_steps steps.
    static constexpr std::uint64_t kKvDemandKeepSteps = 2'000'000;
    void add_kv_demand(std::string_view model, std::string_view dtype, const model::KvDemand& delta,
                       std::int64_t updated_at, std::uint64_t keep_steps = kKvDemandKeepSteps);
    // Their stored history (empty when none).
    model::KvDemand kv_demand(std::string_view model, std::string_view dtype) const;

    // PRAGMA quick_check == "ok".
    bool check_integrity() const;

  private:
    explicit Store(sqlite3* db, StoreOpenReport report);
    // Runs a write, counting its StoreError in health_ before it goes on.
    template <class F>
    auto writing(F&& write) -> decltype(write());
    std::int64_t save_calibration_locked(const CalibrationKey& key, const Calibration& c,
                                         std::int64_t created_at);
    void put_workload_locked(const WorkloadRecord& r);
    void append_sample_locked(const Sample& x, std::size_t keep);
    mutable std::mutex health_mu_;  // not mutex_: status never waits for a busy database
    StoreWriteHealth health_;
    sqlite3* db_;
    mutable std::mutex mutex_;  // one connection, used from the serving loop and the workers
    StoreOpenReport report_;
};

}  // namespace writescope::daemon
