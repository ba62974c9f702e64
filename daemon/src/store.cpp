#include "store.hpp"

#include <sqlite3.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <ctime>
#include <initializer_list>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "log.hpp"

namespace writescope::daemon {
namespace {

// migrations[v] takes a database from schema version v to v + 1, inside one transaction.
constexpr std::array<std::string_view, Store::kSchemaVersion> kMigrations = {
    // 0 → 1: the initial schema.
    R"sql(
CREATE TABLE calibrations (
    id               INTEGER PRIMARY KEY,
    fingerprint      TEXT    NOT NULL,
    geometry         TEXT    NOT NULL,
    dtype            TEXT    NOT NULL,
    software_version TEXT    NOT NULL,
    a                REAL    NOT NULL,  -- CPU seconds per spilled token per layer
    b                REAL    NOT NULL,  -- GPU path seconds per spilled token per layer
    delta            REAL    NOT NULL,  -- GPU path fixed seconds per step
    a_r2             REAL    NOT NULL,
    b_r2             REAL    NOT NULL,
    cpu_intercept    REAL    NOT NULL,  -- CPU fixed seconds per step
    has_gpu          INTEGER NOT NULL,
    points           TEXT    NOT NULL,  -- JSON [{tokens, cpu_seconds, gpu_seconds}]
    seconds_taken    REAL    NOT NULL,
    created_at       INTEGER NOT NULL   -- unix seconds
);
CREATE INDEX calibrations_by_key
    ON calibrations (fingerprint, geometry, dtype, software_version, created_at);
CREATE TABLE workload_history (
    model             TEXT    NOT NULL,
    dtype             TEXT    NOT NULL,
    batch_bucket      INTEGER NOT NULL,
    context_bucket    INTEGER NOT NULL,
    a                 REAL    NOT NULL,
    b                 REAL    NOT NULL,
    delta             REAL    NOT NULL,
    r_target          REAL    NOT NULL,
    r_deployed        REAL    NOT NULL,
    steps             INTEGER NOT NULL,
    step_seconds_mean REAL    NOT NULL,  -- per layer
    step_seconds_stddev REAL  NOT NULL,
    step_seconds_min  REAL    NOT NULL,
    step_seconds_max  REAL    NOT NULL,
    policy_state      TEXT    NOT NULL,  -- Engine::export_policy_state()
    updated_at        INTEGER NOT NULL,  -- unix seconds
    PRIMARY KEY (model, dtype, batch_bucket, context_bucket)
);
CREATE TABLE samples (
    id                INTEGER PRIMARY KEY,
    at_ms             INTEGER NOT NULL,  -- unix milliseconds
    steps             INTEGER NOT NULL,
    sequences         INTEGER NOT NULL,
    a                 REAL    NOT NULL,
    b                 REAL    NOT NULL,
    delta             REAL    NOT NULL,
    r_target          REAL    NOT NULL,
    r_deployed        REAL    NOT NULL,
    step_seconds_mean REAL    NOT NULL
);
)sql",
    // 1 → 2: the routing history the GPU placement puts the hottest experts on the GPU by.
    R"sql(
CREATE TABLE expert_heat (
    model      TEXT    NOT NULL,  -- the served model: name, layers, dtype
    layer      INTEGER NOT NULL,
    expert     INTEGER NOT NULL,
    tokens     INTEGER NOT NULL,  -- tokens routed to it, summed over the daemon's runs
    updated_at INTEGER NOT NULL,  -- unix seconds
    PRIMARY KEY (model, layer, expert)
);
)sql",
    // 2 → 3: the decode steps by the KV they held, which "auto" sizes the KV's VRAM by.
    R"sql(
CREATE TABLE kv_demand (
    model          TEXT    NOT NULL,  -- the KV geometry's name, as in workload_history
    dtype          TEXT    NOT NULL,
    bucket         INTEGER NOT NULL,  -- model::KvDemand::bucket_of(tokens held in the step)
    steps          INTEGER NOT NULL,  -- decode steps, summed over the daemon's runs
    sequence_steps INTEGER NOT NULL,  -- their sequences, summed likewise
    updated_at     INTEGER NOT NULL,  -- unix seconds
    PRIMARY KEY (model, dtype, bucket)
);
)sql",
};

// An open failure: what went wrong, said for the log.
struct OpenFailure {
    std::string what;
    bool locked = false;  // another process holds a lock: the file is fine, leave it alone
};

class Stmt {
  public:
    Stmt(sqlite3* db, std::string_view sql) : db_(db) {
        if (sqlite3_prepare_v2(db, sql.data(), static_cast<int>(sql.size()), &s_, nullptr) !=
            SQLITE_OK)
            throw StoreError(
                fmt::format("SQLite: {} (preparing \"{}\")", sqlite3_errmsg(db), sql.substr(0, 60)),
                sqlite3_extended_errcode(db));
    }
    ~Stmt() { sqlite3_finalize(s_); }
    Stmt(const Stmt&) = delete;
    Stmt& operator=(const Stmt&) = delete;

    Stmt& bind(int i, std::string_view v) {
        check(sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT));
        return *this;
    }
    Stmt& bind(int i, double v) {
        check(sqlite3_bind_double(s_, i, v));
        return *this;
    }
    Stmt& bind(int i, std::int64_t v) {
        check(sqlite3_bind_int64(s_, i, v));
        return *this;
    }
    // true while a row is available.
    bool step() {
        const int rc = sqlite3_step(s_);
        if (rc == SQLITE_ROW) return true;
        if (rc == SQLITE_DONE) return false;
        throw StoreError(fmt::format("SQLite: {}", sqlite3_errmsg(db_)),
                         sqlite3_extended_errcode(db_));
    }
    std::string text(int c) const {
        const auto* p = sqlite3_column_text(s_, c);
        return p ? std::string(reinterpret_cast<const char*>(p),
                               static_cast<std::size_t>(sqlite3_column_bytes(s_, c)))
                 : std::string();
    }
    double real(int c) const { return sqlite3_column_double(s_, c); }
    std::int64_t integer(int c) const { return sqlite3_column_int64(s_, c); }
    // Ready to run again with new bindings.
    void reset() { sqlite3_reset(s_); }

  private:
    void check(int rc) {
        if (rc != SQLITE_OK)
            throw StoreError(fmt::format("SQLite: {}", sqlite3_errmsg(db_)),
                             sqlite3_extended_errcode(db_));
    }
    sqlite3* db_;
    sqlite3_stmt* s_ = nullptr;
};

void exec(sqlite3* db, std::string_view sql) {
    char* err = nullptr;
    if (sqlite3_exec(db, std::string(sql).c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
        std::string msg = err ? err : sqlite3_errmsg(db);
        sqlite3_free(err);
        throw StoreError(fmt::format("SQLite: {}", msg), sqlite3_extended_errcode(db));
    }
}

std::string pragma_text(sqlite3* db, std::string_view sql) {
    Stmt s(db, sql);
    return s.step() ? s.text(0) : std::string();
}

std::string utc_stamp() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
    return buf;
}

// Store::kLockWait for sqlite3_busy_timeout.
constexpr int kLockWaitMs = static_cast<int>(Store::kLockWait.count());

// SQLite's busy handler while a store opens: it retries for Store::kLockWait like
// sqlite3_busy_timeout, and says the first time that it has to wait.
struct OpenWait {
    std::string path;
    const Store::LockWait* on_wait = nullptr;
    bool told = false;
    std::chrono::steady_clock::time_point since;

    static int retry(void* self, int count) {
        auto& w = *static_cast<OpenWait*>(self);
        const auto now = std::chrono::steady_clock::now();
        if (count == 0) w.since = now;
        if (now - w.since >= Store::kLockWait) return 0;  // SQLITE_BUSY
        if (!w.told) {
            w.told = true;
            log_notice("store.waiting",
                       "store {} is locked by another process; waiting for it ({} s at most)",
                       w.path, Store::lock_wait_seconds());
            if (w.on_wait && *w.on_wait) (*w.on_wait)();
        }
        sqlite3_sleep(count < 5 ? 1 << count : 20);  // 1, 2, 4, 8, 16 ms, then every 20 ms
        return 1;
    }
};

// Runs `body` in one write transaction: committed when it returns, rolled back when it throws.
template <class F>
void in_transaction(sqlite3* db, F&& body) {
    exec(db, "BEGIN IMMEDIATE");
    try {
        body();
        exec(db, "COMMIT");
    } catch (...) {
        sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
        throw;
    }
}

// A history that weights its newest counts: when the rows of `table` that `where` selects (its
// parameters bound by bind(Stmt&)) sum past `keep` in column `count`, each column of `counts`
// is halved and the rows whose `count` reaches 0 go. Inside the caller's transaction.
template <class Bind>
void halve_past(sqlite3* db, std::string_view table, std::string_view where, std::string_view count,
                std::initializer_list<std::string_view> counts, std::uint64_t keep,
                const Bind& bind) {
    Stmt total(db,
               fmt::format("SELECT coalesce(sum({}), 0) FROM {} WHERE {}", count, table, where));
    bind(total);
    total.step();
    if (total.integer(0) <= 0 || static_cast<std::uint64_t>(total.integer(0)) <= keep) return;
    std::string set;
    for (const std::string_view c : counts)
        set += fmt::format("{}{} = {} / 2", set.empty() ? "" : ", ", c, c);
    Stmt half(db, fmt::format("UPDATE {} SET {} WHERE {}", table, set, where));
    bind(half);
    half.step();
    Stmt gone(db, fmt::format("DELETE FROM {} WHERE {} AND {} <= 0", table, where, count));
    bind(gone);
    gone.step();
}

// The columns each table of the current schema has, in order: a table altered by hand (a column
// dropped, renamed or added) is found at open, not by a query failing later.
void check_tables(sqlite3* db) {
    static const std::pair<std::string_view, std::string_view> kTables[] = {
        {"calibrations",
         "id,fingerprint,geometry,dtype,software_version,a,b,delta,a_r2,b_r2,cpu_intercept,"
         "has_gpu,points,seconds_taken,created_at"},
        {"workload_history",
         "model,dtype,batch_bucket,context_bucket,a,b,delta,r_target,r_deployed,steps,"
         "step_seconds_mean,step_seconds_stddev,step_seconds_min,step_seconds_max,policy_state,"
         "updated_at"},
        {"samples", "id,at_ms,steps,sequences,a,b,delta,r_target,r_deployed,step_seconds_mean"},
        {"expert_heat", "model,layer,expert,tokens,updated_at"},
        {"kv_demand", "model,dtype,bucket,steps,sequence_steps,updated_at"},
    };
    for (const auto& [table, expected] : kTables) {
        Stmt s(db, fmt::format("SELECT name FROM pragma_table_info('{}')", table));
        std::string columns;
        while (s.step()) {
            if (!columns.empty()) columns += ',';
            columns += s.text(0);
        }
        if (columns.empty()) throw OpenFailure{fmt::format("table {} is missing", table)};
        if (columns != expected)
            throw OpenFailure{
                fmt::format("table {} has columns ({}), not those of schema version "
                            "{} ({})",
                            table, columns, Store::kSchemaVersion, expected)};
    }
}

// Applies the pragmas, checks integrity and migrates; throws OpenFailure when the database is
// not one this release can use. wait: the busy handler while it runs (null: a plain timeout).
void prepare(sqlite3* db, StoreOpenReport& report, bool on_disk, OpenWait* wait) {
    try {
        // Another process may hold a lock for a moment: wait for it rather than fail.
        if (wait)
            sqlite3_busy_handler(db, &OpenWait::retry, wait);
        else
            sqlite3_busy_timeout(db, kLockWaitMs);
        // Reading the schema is the first access to the file: a file that is not a database
        // fails here.
        const int version = std::stoi(pragma_text(db, "PRAGMA user_version"));
        if (on_disk && pragma_text(db, "PRAGMA journal_mode=WAL") != "wal")
            throw OpenFailure{"cannot switch the database to WAL mode"};
        // NORMAL in WAL mode: a committed transaction survives a crash of the process (SIGKILL);
        // only a power loss may lose the newest ones, never the file's consistency.
        exec(db, "PRAGMA synchronous=NORMAL");
        if (auto check = pragma_text(db, "PRAGMA quick_check"); check != "ok") {
            // One log line: the check lists a line per damaged page.
            std::replace(check.begin(), check.end(), '\n', ' ');
            if (check.size() > 200) check = check.substr(0, 200) + "...";
            throw OpenFailure{fmt::format("integrity check failed: {}", check)};
        }
        if (version > Store::kSchemaVersion)
            throw OpenFailure{fmt::format("schema version {} is newer than this release's ({})",
                                          version, Store::kSchemaVersion)};
        // No release wrote a negative version: the file was altered, and no migration applies.
        if (version < 0)
            throw OpenFailure{
                fmt::format("schema version {} is unknown (this release knows 0 to {})", version,
                            Store::kSchemaVersion)};
        if (version == 0) {
            Stmt s(db, "SELECT count(*) FROM sqlite_schema");
            s.step();
            if (s.integer(0) != 0)
                throw OpenFailure{"the file is an SQLite database of some other program"};
        }
        report.schema_version = version;
        for (int v = version; v < Store::kSchemaVersion; ++v) {
            exec(db, "BEGIN IMMEDIATE");
            try {
                exec(db, kMigrations[static_cast<std::size_t>(v)]);
                exec(db, fmt::format("PRAGMA user_version = {}", v + 1));
                exec(db, "COMMIT");
            } catch (...) {
                sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
                throw;
            }
            if (report.migrated_from < 0) report.migrated_from = v;
            report.schema_version = v + 1;
        }
        check_tables(db);
        // From now on `wait` is gone: the store's own reads and writes wait as long.
        sqlite3_busy_timeout(db, kLockWaitMs);
    } catch (const StoreError& e) {
        const int primary = e.sqlite_code() & 0xff;
        throw OpenFailure{e.what(), primary == SQLITE_BUSY || primary == SQLITE_LOCKED};
    } catch (const std::logic_error&) {  // std::stoi: invalid_argument, out_of_range
        throw OpenFailure{"unreadable schema version"};
    }
}

sqlite3* open_file(const std::filesystem::path& path, StoreOpenReport& report, OpenWait& wait) {
    sqlite3* db = nullptr;
    const int rc =
        sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
    if (rc != SQLITE_OK) {
        std::string msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
        sqlite3_close(db);
        throw OpenFailure{msg};
    }
    try {
        prepare(db, report, true, &wait);
    } catch (...) {
        sqlite3_close(db);
        throw;
    }
    return db;
}

// Renames the database and its WAL and shared-memory files to <name>.bad-<stamp>[-wal|-shm].
std::string move_aside(const std::filesystem::path& path) {
    const auto target = path.string() + ".bad-" + utc_stamp();
    std::error_code ec;
    std::filesystem::rename(path, target, ec);
    if (ec) throw OpenFailure{fmt::format("cannot move it aside: {}", ec.message())};
    for (const auto* suffix : {"-wal", "-shm"}) {
        std::error_code ignored;
        if (std::filesystem::exists(path.string() + suffix, ignored))
            std::filesystem::rename(path.string() + suffix, target + suffix, ignored);
    }
    return target;
}

nlohmann::json points_json(const Calibration& c) {
    auto arr = nlohmann::json::array();
    for (const auto& p : c.points)
        arr.push_back(
            {{"tokens", p.tokens}, {"cpu_seconds", p.cpu_seconds}, {"gpu_seconds", p.gpu_seconds}});
    return arr;
}

std::vector<CalibrationPoint> parse_points(const std::string& text) {
    std::vector<CalibrationPoint> out;
    const auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_array()) return out;
    for (const auto& p : j) {
        if (!p.is_object()) continue;
        out.push_back({p.value("tokens", std::size_t{0}), p.value("cpu_seconds", 0.0),
                       p.value("gpu_seconds", 0.0)});
    }
    return out;
}

constexpr std::string_view kCalibrationColumns =
    "id, fingerprint, geometry, dtype, software_version, a, b, delta, a_r2, b_r2, "
    "cpu_intercept, has_gpu, points, seconds_taken, created_at";

StoredCalibration read_calibration(const Stmt& s) {
    StoredCalibration c;
    c.id = s.integer(0);
    c.key = {s.text(1), s.text(2), s.text(3), s.text(4)};
    c.calibration.a = s.real(5);
    c.calibration.b = s.real(6);
    c.calibration.delta = s.real(7);
    c.calibration.a_r2 = s.real(8);
    c.calibration.b_r2 = s.real(9);
    c.calibration.cpu_intercept = s.real(10);
    c.calibration.has_gpu = s.integer(11) != 0;
    c.calibration.points = parse_points(s.text(12));
    c.calibration.seconds_taken = s.real(13);
    c.created_at = s.integer(14);
    return c;
}

constexpr std::string_view kWorkloadColumns =
    "model, dtype, batch_bucket, context_bucket, a, b, delta, r_target, r_deployed, steps, "
    "step_seconds_mean, step_seconds_stddev, step_seconds_min, step_seconds_max, policy_state, "
    "updated_at";

WorkloadRecord read_workload(const Stmt& s) {
    WorkloadRecord r;
    r.key = {s.text(0), s.text(1), s.integer(2), s.integer(3)};
    r.a = s.real(4);
    r.b = s.real(5);
    r.delta = s.real(6);
    r.r_target = s.real(7);
    r.r_deployed = s.real(8);
    r.steps = static_cast<std::uint64_t>(s.integer(9));
    r.step_seconds_mean = s.real(10);
    r.step_seconds_stddev = s.real(11);
    r.step_seconds_min = s.real(12);
    r.step_seconds_max = s.real(13);
    r.policy_state = s.text(14);
    r.updated_at = s.integer(15);
    return r;
}

}  // namespace

Store::Store(sqlite3* db, StoreOpenReport report) : db_(db), report_(std::move(report)) {}

Store::~Store() {
    sqlite3_close(db_);
}

std::unique_ptr<Store> Store::open_in_memory() {
    sqlite3* db = nullptr;
    StoreOpenReport report;
    report.in_memory = true;
    report.created = true;
    if (sqlite3_open(":memory:", &db) != SQLITE_OK)
        throw StoreError("cannot open SQLite in memory");
    try {
        prepare(db, report, false, nullptr);
    } catch (const OpenFailure& f) {
        sqlite3_close(db);
        throw StoreError(f.what);
    }
    return std::unique_ptr<Store>(new Store(db, std::move(report)));
}

std::unique_ptr<Store> Store::open(const std::filesystem::path& state_dir,
                                   const LockWait& on_lock_wait) {
    StoreOpenReport report;
    const auto path = state_dir / kFileName;
    OpenWait wait;
    wait.path = path.string();
    wait.on_wait = &on_lock_wait;
    report.path = path;
    bool locked = false;
    std::error_code ec;
    if (!std::filesystem::is_directory(state_dir, ec)) {
        std::filesystem::create_directories(state_dir, ec);
        if (!ec) ::chmod(state_dir.c_str(), 0750);  // history and hardware facts are not public
    }
    if (ec) {
        report.problem = fmt::format("cannot create the state directory {}: {}", state_dir.string(),
                                     ec.message());
    } else {
        report.created = !std::filesystem::exists(path, ec);
        try {
            sqlite3* db = open_file(path, report, wait);
            log_info("store.opened", "store {} (schema version {}{})", path.string(),
                     report.schema_version, report.created ? ", new" : "");
            if (sqlite3_db_readonly(db, "main") == 1) {
                // Reads work; every write would fail. Kept (the file is sound), and said.
                report.problem = "the database is read-only: nothing new will be saved";
                log_error("store.read-only",
                          "store {} is read-only (check the permissions of the file and of {}): "
                          "calibrations, history and samples will not be saved",
                          path.string(), state_dir.string());
            }
            if (report.migrated_from >= 0)
                log_notice("store.migrated", "store {} migrated from schema version {} to {}",
                           path.string(), report.migrated_from, report.schema_version);
            return std::unique_ptr<Store>(new Store(db, std::move(report)));
        } catch (const OpenFailure& bad) {
            report.problem = bad.what;
            locked = bad.locked;
            if (locked)
                report.problem += fmt::format(" (locked by another process for over {} s)",
                                              Store::lock_wait_seconds());
        }
        // The file is unusable: keep it for inspection, start afresh. A locked file is sound
        // and in someone else's hands: it is left alone.
        if (!locked) try {
                report.moved_aside_to = move_aside(path);
                log_error("store.moved-aside",
                          "store {} is unusable ({}); moved it aside to {} and created a fresh one",
                          path.string(), report.problem, report.moved_aside_to);
                report.created = true;
                report.migrated_from = -1;
                sqlite3* db = open_file(path, report, wait);
                return std::unique_ptr<Store>(new Store(db, std::move(report)));
            } catch (const OpenFailure& again) {
                report.problem += "; " + again.what;
            }
    }
    log_error("store.in-memory",
              "cannot use a store in {} ({}); running with an in-memory store: calibrations and "
              "history will not persist",
              state_dir.string(), report.problem);
    auto mem = open_in_memory();
    auto problem = report.problem;
    mem->report_ = std::move(report);
    mem->report_.in_memory = true;
    mem->report_.problem = std::move(problem);
    mem->report_.schema_version = kSchemaVersion;
    return mem;
}

std::optional<StoredCalibration> Store::latest_calibration(const CalibrationKey& key) const {
    std::lock_guard lock(mutex_);
    Stmt s(db_, fmt::format("SELECT {} FROM calibrations WHERE fingerprint = ?1 AND geometry = ?2 "
                            "AND dtype = ?3 AND software_version = ?4 "
                            "ORDER BY created_at DESC, id DESC LIMIT 1",
                            kCalibrationColumns));
    s.bind(1, key.fingerprint)
        .bind(2, key.geometry)
        .bind(3, key.dtype)
        .bind(4, key.software_version);
    if (!s.step()) return std::nullopt;
    return read_calibration(s);
}

template <class F>
auto Store::writing(F&& write) -> decltype(write()) {
    try {
        return write();
    } catch (const StoreError& e) {
        std::lock_guard lock(health_mu_);
        ++health_.write_failures;
        health_.last_write_error = e.what();
        health_.last_write_failed_at_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                              std::chrono::system_clock::now().time_since_epoch())
                                              .count();
        throw;
    }
}

StoreWriteHealth Store::write_health() const {
    std::lock_guard lock(health_mu_);
    return health_;
}

std::int64_t Store::save_calibration(const CalibrationKey& key, const Calibration& c,
                                     std::int64_t created_at) {
    return writing([&] { return save_calibration_locked(key, c, created_at); });
}

std::int64_t Store::save_calibration_locked(const CalibrationKey& key, const Calibration& c,
                                            std::int64_t created_at) {
    std::lock_guard lock(mutex_);
    Stmt s(db_,
           "INSERT INTO calibrations (fingerprint, geometry, dtype, software_version, a, b, delta, "
           "a_r2, b_r2, cpu_intercept, has_gpu, points, seconds_taken, created_at) VALUES "
           "(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)");
    s.bind(1, key.fingerprint)
        .bind(2, key.geometry)
        .bind(3, key.dtype)
        .bind(4, key.software_version);
    s.bind(5, c.a).bind(6, c.b).bind(7, c.delta).bind(8, c.a_r2).bind(9, c.b_r2);
    s.bind(10, c.cpu_intercept).bind(11, std::int64_t{c.has_gpu ? 1 : 0});
    s.bind(12, points_json(c).dump()).bind(13, c.seconds_taken).bind(14, created_at);
    s.step();
    return static_cast<std::int64_t>(sqlite3_last_insert_rowid(db_));
}

std::vector<StoredCalibration> Store::calibrations(std::size_t limit) const {
    std::lock_guard lock(mutex_);
    Stmt s(db_, fmt::format("SELECT {} FROM calibrations ORDER BY created_at DESC, id DESC "
                            "LIMIT ?1",
                            kCalibrationColumns));
    s.bind(1, static_cast<std::int64_t>(limit));
    std::vector<StoredCalibration> out;
    while (s.step())
        out.push_back(read_calibration(s));
    return out;
}

void Store::put_workload(const WorkloadRecord& r) {
    writing([&] { put_workload_locked(r); });
}

void Store::put_workload_locked(const WorkloadRecord& r) {
    std::lock_guard lock(mutex_);
    Stmt s(db_,
           fmt::format("INSERT OR REPLACE INTO workload_history ({}) VALUES "
                       "(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
                       kWorkloadColumns));
    s.bind(1, r.key.model).bind(2, r.key.dtype).bind(3, r.key.batch_bucket);
    s.bind(4, r.key.context_bucket).bind(5, r.a).bind(6, r.b).bind(7, r.delta);
    s.bind(8, r.r_target).bind(9, r.r_deployed).bind(10, static_cast<std::int64_t>(r.steps));
    s.bind(11, r.step_seconds_mean).bind(12, r.step_seconds_stddev).bind(13, r.step_seconds_min);
    s.bind(14, r.step_seconds_max).bind(15, r.policy_state).bind(16, r.updated_at);
    s.step();
}

std::vector<WorkloadRecord> Store::workloads() const {
    std::lock_guard lock(mutex_);
    Stmt s(db_, fmt::format("SELECT {} FROM workload_history ORDER BY updated_at DESC, model, "
                            "dtype, batch_bucket, context_bucket",
                            kWorkloadColumns));
    std::vector<WorkloadRecord> out;
    while (s.step())
        out.push_back(read_workload(s));
    return out;
}

std::optional<WorkloadRecord> Store::latest_workload(std::string_view model,
                                                     std::string_view dtype) const {
    std::lock_guard lock(mutex_);
    Stmt s(db_, fmt::format("SELECT {} FROM workload_history WHERE model = ?1 AND dtype = ?2 "
                            "ORDER BY updated_at DESC, steps DESC LIMIT 1",
                            kWorkloadColumns));
    s.bind(1, model).bind(2, dtype);
    if (!s.step()) return std::nullopt;
    return read_workload(s);
}

void Store::append_sample(const Sample& x, std::size_t keep) {
    writing([&] { append_sample_locked(x, keep); });
}

void Store::append_sample_locked(const Sample& x, std::size_t keep) {
    std::lock_guard lock(mutex_);
    in_transaction(db_, [&] {
        Stmt s(db_,
               "INSERT INTO samples (at_ms, steps, sequences, a, b, delta, r_target, r_deployed, "
               "step_seconds_mean) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)");
        s.bind(1, x.at_ms).bind(2, static_cast<std::int64_t>(x.steps));
        s.bind(3, static_cast<std::int64_t>(x.sequences)).bind(4, x.a).bind(5, x.b);
        s.bind(6, x.delta).bind(7, x.r_target).bind(8, x.r_deployed).bind(9, x.step_seconds_mean);
        s.step();
        // Row ids grow by one per insert, so the newest `keep` rows are the ids above this.
        Stmt d(db_, "DELETE FROM samples WHERE id <= ?1");
        d.bind(1, static_cast<std::int64_t>(sqlite3_last_insert_rowid(db_)) -
                      static_cast<std::int64_t>(keep));
        d.step();
    });
}

std::vector<Sample> Store::samples(std::size_t limit) const {
    std::lock_guard lock(mutex_);
    Stmt s(db_,
           "SELECT at_ms, steps, sequences, a, b, delta, r_target, r_deployed, step_seconds_mean "
           "FROM samples ORDER BY id DESC LIMIT ?1");
    s.bind(1, static_cast<std::int64_t>(limit));
    std::vector<Sample> out;
    while (s.step()) {
        Sample x;
        x.at_ms = s.integer(0);
        x.steps = static_cast<std::uint64_t>(s.integer(1));
        x.sequences = static_cast<std::uint64_t>(s.integer(2));
        x.a = s.real(3);
        x.b = s.real(4);
        x.delta = s.real(5);
        x.r_target = s.real(6);
        x.r_deployed = s.real(7);
        x.step_seconds_mean = s.real(8);
        out.push_back(x);
    }
    return out;
}

std::size_t Store::sample_count() const {
    std::lock_guard lock(mutex_);
    Stmt s(db_, "SELECT count(*) FROM samples");
    s.step();
    return static_cast<std::size_t>(s.integer(0));
}

void Store::add_expert_heat(std::string_view model, const model::ExpertHeat& delta,
                            std::int64_t updated_at, std::uint64_t keep_tokens) {
    writing([&] {
        std::lock_guard lock(mutex_);
        in_transaction(db_, [&] {
            Stmt s(db_,
                   "INSERT INTO expert_heat (model, layer, expert, tokens, updated_at) VALUES "
                   "(?1, ?2, ?3, ?4, ?5) ON CONFLICT (model, layer, expert) DO UPDATE SET "
                   "tokens = tokens + excluded.tokens, updated_at = excluded.updated_at");
            for (std::size_t l = 0; l < delta.counts.size(); ++l)
                for (std::size_t e = 0; e < delta.counts[l].size(); ++e) {
                    if (!delta.counts[l][e]) continue;
                    s.bind(1, model).bind(2, static_cast<std::int64_t>(l));
                    s.bind(3, static_cast<std::int64_t>(e));
                    s.bind(4, static_cast<std::int64_t>(delta.counts[l][e])).bind(5, updated_at);
                    s.step();
                    s.reset();
                }
            halve_past(db_, "expert_heat", "model = ?1", "tokens", {"tokens"}, keep_tokens,
                       [&](Stmt& st) { st.bind(1, model); });
        });
    });
}

model::ExpertHeat Store::expert_heat(std::string_view model) const {
    std::lock_guard lock(mutex_);
    Stmt s(db_, "SELECT layer, expert, tokens FROM expert_heat WHERE model = ?1");
    s.bind(1, model);
    model::ExpertHeat h;
    while (s.step()) {
        const std::int64_t l = s.integer(0), e = s.integer(1), t = s.integer(2);
        // Rows a hand could have written: out-of-range indices and negative counts are skipped.
        if (l < 0 || e < 0 || t < 0 || l >= 4096 || e >= 4096) continue;
        auto& counts = h.counts;
        if (counts.size() <= static_cast<std::size_t>(l))
            counts.resize(static_cast<std::size_t>(l) + 1);
        auto& row = counts[static_cast<std::size_t>(l)];
        if (row.size() <= static_cast<std::size_t>(e)) row.resize(static_cast<std::size_t>(e) + 1);
        row[static_cast<std::size_t>(e)] = static_cast<std::uint64_t>(t);
    }
    return h;
}

void Store::add_kv_demand(std::string_view model, std::string_view dtype,
                          const model::KvDemand& delta, std::int64_t updated_at,
                          std::uint64_t keep_steps) {
    if (delta.empty()) return;
    writing([&] {
        std::lock_guard lock(mutex_);
        in_transaction(db_, [&] {
            Stmt s(db_,
                   "INSERT INTO kv_demand (model, dtype, bucket, steps, sequence_steps, "
                   "updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (model, dtype, "
                   "bucket) DO UPDATE SET steps = steps + excluded.steps, sequence_steps = "
                   "sequence_steps + excluded.sequence_steps, updated_at = excluded.updated_at");
            for (const auto& [b, x] : delta.buckets) {
                s.bind(1, model).bind(2, dtype).bind(3, static_cast<std::int64_t>(b));
                s.bind(4, static_cast<std::int64_t>(x.steps));
                s.bind(5, static_cast<std::int64_t>(x.sequence_steps)).bind(6, updated_at);
                s.step();
                s.reset();
            }
            halve_past(db_, "kv_demand", "model = ?1 AND dtype = ?2", "steps",
                       {"steps", "sequence_steps"}, keep_steps,
                       [&](Stmt& st) { st.bind(1, model).bind(2, dtype); });
        });
    });
}

model::KvDemand Store::kv_demand(std::string_view model, std::string_view dtype) const {
    std::lock_guard lock(mutex_);
    Stmt s(db_,
           "SELECT bucket, steps, sequence_steps FROM kv_demand WHERE model = ?1 AND dtype = ?2");
    s.bind(1, model).bind(2, dtype);
    model::KvDemand d;
    while (s.step()) {
        const std::int64_t b = s.integer(0), n = s.integer(1), q = s.integer(2);
        // Rows a hand could have written: buckets out of range and negative counts are skipped.
        if (b < 0 || b > model::KvDemand::kMaxBucket || n <= 0 || q < 0) continue;
        d.buckets[static_cast<std::uint32_t>(b)] = {static_cast<std::uint64_t>(n),
                                                    static_cast<std::uint64_t>(q)};
    }
    return d;
}

bool Store::check_integrity() const {
    std::lock_guard lock(mutex_);
    try {
        return pragma_text(db_, "PRAGMA quick_check") == "ok";
    } catch (const StoreError&) {
        return false;
    }
}

}  // namespace writescope::daemon
