#include <catch2/catch.hpp>

#include <sqlite3.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include <fmt/format.h>

#include "store.hpp"
#include "store_lock_holder.hpp"
#include "temp_dir.hpp"
#include "test_seed.hpp"

using namespace writescope;
using namespace writescope::daemon;
using writescope::test::StoreLockHolder;
using writescope::test::TempDir;

namespace {

CalibrationKey key_a() {
    return {"gpu=none;cpu=x;cores=2", "qwen3-30b-a3b:L48", "bf16", "0.1.0"};
}

Calibration some_calibration(double a) {
    Calibration c;
    c.a = a;
    c.b = 2e-9;
    c.delta = 3e-5;
    c.a_r2 = 0.99;
    c.b_r2 = 0.98;
    c.cpu_intercept = 1e-6;
    c.has_gpu = true;
    c.points = {{1024, 1e-3, 2e-3}, {4096, 4e-3, 5e-3}};
    c.seconds_taken = 1.5;
    return c;
}

WorkloadRecord some_workload(std::int64_t batch, std::int64_t updated) {
    WorkloadRecord r;
    r.key = {"qwen3-30b-a3b", "bf16", batch, 8192};
    r.a = 1e-8;
    r.b = 2e-8;
    r.r_target = 0.6;
    r.r_deployed = 0.55;
    r.steps = 1000;
    r.step_seconds_mean = 0.002;
    r.policy_state = "writescope-policy v1\na 1e-8\n";
    r.updated_at = updated;
    return r;
}

void write_bytes(const std::filesystem::path& p, std::string_view bytes, std::size_t offset) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(f);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::size_t count_bad_files(const std::filesystem::path& dir) {
    std::size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir))
        if (e.path().filename().string().starts_with("writescope.db.bad-")) ++n;
    return n;
}

}  // namespace

TEST_CASE("a new store is created with the current schema and WAL", "[unit][daemon][store]") {
    TempDir dir;
    auto store = Store::open(dir.path() / "state");
    CHECK(store->report().created);
    CHECK_FALSE(store->report().in_memory);
    CHECK(store->report().schema_version == Store::kSchemaVersion);
    CHECK(store->report().migrated_from == 0);
    CHECK(std::filesystem::exists(dir.path() / "state" / "writescope.db"));
    CHECK(store->check_integrity());
    store.reset();
    // Reopening migrates nothing and keeps the file.
    store = Store::open(dir.path() / "state");
    CHECK_FALSE(store->report().created);
    CHECK(store->report().migrated_from == -1);
}

TEST_CASE("calibrations round-trip and the newest matching one wins", "[unit][daemon][store]") {
    TempDir dir;
    {
        auto store = Store::open(dir.path());
        CHECK_FALSE(store->latest_calibration(key_a()));
        store->save_calibration(key_a(), some_calibration(1e-8), 1000);
        store->save_calibration(key_a(), some_calibration(3e-8), 2000);
        auto other = key_a();
        other.software_version = "0.2.0";
        store->save_calibration(other, some_calibration(9e-8), 3000);
    }
    auto store = Store::open(dir.path());
    const auto got = store->latest_calibration(key_a());
    REQUIRE(got);
    CHECK(got->created_at == 2000);
    CHECK(got->calibration.a == 3e-8);
    CHECK(got->calibration.b == 2e-9);
    CHECK(got->calibration.delta == 3e-5);
    CHECK(got->calibration.has_gpu);
    REQUIRE(got->calibration.points.size() == 2);
    CHECK(got->calibration.points[1].tokens == 4096);
    CHECK(got->calibration.points[1].gpu_seconds == 5e-3);
    CHECK(got->key == key_a());
    auto dtype_differs = key_a();
    dtype_differs.dtype = "fp16";
    CHECK_FALSE(store->latest_calibration(dtype_differs));
    CHECK(store->calibrations(10).size() == 3);
    CHECK(store->calibrations(10).front().created_at == 3000);
}

TEST_CASE("workload history upserts per workload key", "[unit][daemon][store]") {
    TempDir dir;
    auto store = Store::open(dir.path());
    store->put_workload(some_workload(1, 100));
    store->put_workload(some_workload(4, 200));
    auto again = some_workload(1, 300);
    again.steps = 5000;
    store->put_workload(again);
    const auto all = store->workloads();
    REQUIRE(all.size() == 2);
    CHECK(all[0].key.batch_bucket == 1);
    CHECK(all[0].steps == 5000);
    CHECK(all[0].policy_state == again.policy_state);
    const auto latest = store->latest_workload("qwen3-30b-a3b", "bf16");
    REQUIRE(latest);
    CHECK(latest->updated_at == 300);
    CHECK_FALSE(store->latest_workload("qwen3-30b-a3b", "fp16"));
}

TEST_CASE("the sample log keeps the newest rows only", "[unit][daemon][store]") {
    TempDir dir;
    auto store = Store::open(dir.path());
    REQUIRE_FALSE(store->report().in_memory);
    for (int i = 0; i < 25; ++i) {
        Sample s;
        s.at_ms = i;
        s.steps = static_cast<std::uint64_t>(i);
        store->append_sample(s, 10);
    }
    CHECK(store->sample_count() == 10);
    const auto rows = store->samples(100);
    REQUIRE(rows.size() == 10);
    CHECK(rows.front().steps == 24);
    CHECK(rows.back().steps == 15);
    store->append_sample(Sample{}, 3);  // a smaller bound takes effect at once
    CHECK(store->sample_count() == 3);
    store.reset();  // and the file keeps what was left
    store = Store::open(dir.path());
    CHECK(store->sample_count() == 3);
}

TEST_CASE("a file that is not a database is moved aside", "[unit][daemon][store]") {
    TempDir dir;
    std::ofstream(dir / "writescope.db") << "this is not an SQLite database, just some text\n"
                                         << std::string(8192, 'x');
    std::ofstream(dir / "writescope.db-wal") << "junk";
    auto store = Store::open(dir.path());
    CHECK_FALSE(store->report().in_memory);
    CHECK(store->report().created);
    CHECK_FALSE(store->report().moved_aside_to.empty());
    CHECK_THAT(store->report().problem, Catch::Contains("not a database"));
    CHECK(count_bad_files(dir.path()) >= 1);
    // The fresh store works.
    store->save_calibration(key_a(), some_calibration(1e-8), 1);
    CHECK(store->latest_calibration(key_a()));
}

TEST_CASE("a database with damaged pages is moved aside", "[unit][daemon][store]") {
    TempDir dir;
    {
        auto store = Store::open(dir.path());
        for (int i = 0; i < 200; ++i)
            store->put_workload(some_workload(i, i));
    }
    // Checkpointed on close: the data is in the main file. Scribble over the pages after the
    // first (which holds the header, so SQLite still opens the file).
    const auto size = std::filesystem::file_size(dir / "writescope.db");
    REQUIRE(size > 8192);
    auto rng = writescope::test::seeded_rng("store page damage");
    std::string noise(size - 4096, '\0');
    for (auto& c : noise)
        c = static_cast<char>(rng());
    write_bytes(dir / "writescope.db", noise, 4096);
    auto store = Store::open(dir.path());
    CHECK_FALSE(store->report().in_memory);
    CHECK_FALSE(store->report().moved_aside_to.empty());
    CHECK(store->workloads().empty());
    CHECK(count_bad_files(dir.path()) == 1);
}

TEST_CASE("a database from a newer release or another program is set aside",
          "[unit][daemon][store]") {
    TempDir dir;
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open((dir / "writescope.db").c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db, "CREATE TABLE t(x); PRAGMA user_version = 99;", nullptr, nullptr,
                         nullptr) == SQLITE_OK);
    sqlite3_close(db);
    auto store = Store::open(dir.path());
    CHECK_THAT(store->report().problem, Catch::Contains("newer"));
    CHECK(store->report().schema_version == Store::kSchemaVersion);

    TempDir dir2;
    REQUIRE(sqlite3_open((dir2 / "writescope.db").c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db, "CREATE TABLE other(x);", nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
    store = Store::open(dir2.path());
    CHECK_THAT(store->report().problem, Catch::Contains("some other program"));
}

TEST_CASE("an unusable state directory gives an in-memory store", "[unit][daemon][store]") {
    TempDir dir;
    std::ofstream(dir / "file") << "x";
    // A state "directory" below a regular file cannot be created, by anyone.
    auto store = Store::open(dir / "file" / "state");
    CHECK(store->report().in_memory);
    CHECK_FALSE(store->report().problem.empty());
    store->put_workload(some_workload(1, 1));
    CHECK(store->workloads().size() == 1);
}

TEST_CASE("a database locked by another process is waited for, never moved aside",
          "[unit][daemon][store]") {
    TempDir dir;
    StoreLockHolder lock(dir.path());  // on a valid store (WAL)
    // Released once the opener is waiting for it (from its busy handler, on this thread).
    int waits = 0;
    auto store = Store::open(dir.path(), [&] {
        ++waits;
        lock.release();
    });
    CHECK(waits == 1);
    CHECK_FALSE(store->report().in_memory);
    CHECK(store->report().moved_aside_to.empty());
    CHECK(count_bad_files(dir.path()) == 0);
}

TEST_CASE("a schema version this release does not know, negative or newer, is set aside",
          "[unit][daemon][store]") {
    // Negative versions indexed the migration table out of range (SIGSEGV at -1, SIGABRT at -2).
    for (const int version : {-1, -2, -5, -2147483647, Store::kSchemaVersion + 1, 99}) {
        INFO(version);
        TempDir dir;
        {
            auto first = Store::open(dir.path());
            first->save_calibration(key_a(), some_calibration(1e-8), 100);
        }
        sqlite3* db = nullptr;
        REQUIRE(sqlite3_open((dir / "writescope.db").c_str(), &db) == SQLITE_OK);
        REQUIRE(sqlite3_exec(db, fmt::format("PRAGMA user_version = {};", version).c_str(), nullptr,
                             nullptr, nullptr) == SQLITE_OK);
        sqlite3_close(db);
        auto store = Store::open(dir.path());
        CHECK_FALSE(store->report().in_memory);
        CHECK_FALSE(store->report().moved_aside_to.empty());
        CHECK_THAT(store->report().problem,
                   Catch::Contains(fmt::format("schema version {}", version)));
        CHECK(store->report().schema_version == Store::kSchemaVersion);
        CHECK(count_bad_files(dir.path()) == 1);
        CHECK_FALSE(store->latest_calibration(key_a()));
        // The fresh store opens as it is, the next time.
        store.reset();
        store = Store::open(dir.path());
        CHECK(store->report().moved_aside_to.empty());
    }
}

TEST_CASE("a table altered by hand is found at open and the file set aside",
          "[unit][daemon][store]") {
    for (const auto* alteration :
         {"DROP TABLE samples; CREATE TABLE samples (id INTEGER PRIMARY KEY, at TEXT);",
          "ALTER TABLE samples DROP COLUMN r_deployed;", "ALTER TABLE samples ADD COLUMN x;",
          "DROP TABLE workload_history;", "ALTER TABLE calibrations RENAME COLUMN a TO aa;"}) {
        INFO(alteration);
        TempDir dir;
        Store::open(dir.path())->append_sample({}, 10);
        sqlite3* db = nullptr;
        REQUIRE(sqlite3_open((dir / "writescope.db").c_str(), &db) == SQLITE_OK);
        REQUIRE(sqlite3_exec(db, alteration, nullptr, nullptr, nullptr) == SQLITE_OK);
        sqlite3_close(db);
        auto store = Store::open(dir.path());
        CHECK_FALSE(store->report().moved_aside_to.empty());
        CHECK_THAT(store->report().problem, Catch::Contains("table"));
        // Reads and writes of every table work on the fresh one (history answered 500 before).
        CHECK_NOTHROW(store->samples(10));
        CHECK_NOTHROW(store->workloads());
        CHECK_NOTHROW(store->append_sample({}, 10));
    }
}

TEST_CASE("failed writes are counted with the last error", "[unit][daemon][store]") {
    TempDir dir;
    auto store = Store::open(dir.path());
    CHECK(store->write_health().write_failures == 0);
    // Another process makes every write fail (as a read-only file or a full disk would).
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open((dir / "writescope.db").c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "CREATE TRIGGER no_samples BEFORE INSERT ON samples BEGIN SELECT "
                         "RAISE(FAIL, 'disk says no'); END; CREATE TRIGGER no_history BEFORE "
                         "INSERT ON workload_history BEGIN SELECT RAISE(FAIL, 'disk says no'); "
                         "END;",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
    CHECK_THROWS_AS(store->append_sample({}, 10), StoreError);
    CHECK_THROWS_AS(store->put_workload(some_workload(1, 10)), StoreError);
    const auto h = store->write_health();
    CHECK(h.write_failures == 2);
    CHECK_THAT(h.last_write_error, Catch::Contains("disk says no"));
    CHECK(h.last_write_failed_at_ms > 0);
    CHECK_NOTHROW(store->save_calibration(key_a(), some_calibration(1e-8), 100));
    CHECK(store->write_health().write_failures == 2);
}

TEST_CASE("a read-only database is said to be one at open", "[unit][daemon][store]") {
    TempDir dir;
    Store::open(dir.path())->save_calibration(key_a(), some_calibration(1e-8), 100);
    // The WAL's shared memory file must exist for a read-only open of a WAL database.
    std::filesystem::permissions(dir / "writescope.db", std::filesystem::perms::owner_read |
                                                            std::filesystem::perms::group_read);
    if (::geteuid() == 0) {
        // Root writes whatever the mode says: nothing to see here.
        SUCCEED("running as root: a file's mode does not make it read-only");
        return;
    }
    auto store = Store::open(dir.path());
    CHECK_THAT(store->report().problem, Catch::Contains("read-only"));
    CHECK(store->latest_calibration(key_a()));
    CHECK_THROWS_AS(store->append_sample({}, 10), StoreError);
    CHECK(store->write_health().write_failures == 1);
}

TEST_CASE("the routing history adds up per model across runs and skips rows it cannot use",
          "[unit][daemon][store]") {
    TempDir dir;
    model::ExpertHeat a;
    a.counts = {{}, {3, 0, 5}};  // layer 0 dense
    {
        auto store = Store::open(dir.path() / "state");
        CHECK(store->expert_heat("m").counts.empty());
        store->add_expert_heat("m", a, 100);
        store->add_expert_heat("m", a, 200);
        model::ExpertHeat other;
        other.counts = {{7}};
        store->add_expert_heat("other", other, 200);
    }
    // A restart reads what the runs wrote.
    {
        auto store = Store::open(dir.path() / "state");
        CHECK_FALSE(store->report().created);
        const model::ExpertHeat h = store->expert_heat("m");
        REQUIRE(h.counts.size() == 2);
        CHECK(h.counts[0].empty());
        CHECK(h.counts[1] == std::vector<std::uint64_t>{6, 0, 10});
        CHECK(store->expert_heat("other").counts == std::vector<std::vector<std::uint64_t>>{{7}});
    }
    // Rows written by hand with negative or huge indices, or negative counts, are skipped.
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open((dir.path() / "state" / "writescope.db").c_str(), &db) == SQLITE_OK);
    REQUIRE(
        sqlite3_exec(db,
                     "INSERT INTO expert_heat VALUES ('m', -1, 0, 5, 0), ('m', 0, 99999, 5, 0), "
                     "('m', 1, 1, -4, 0)",
                     nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
    auto store = Store::open(dir.path() / "state");
    const model::ExpertHeat h = store->expert_heat("m");
    REQUIRE(h.counts.size() == 2);
    CHECK(h.counts[1] == std::vector<std::uint64_t>{6, 0, 10});
}

TEST_CASE(
    "the routing history is halved past its token cap, so the placement follows the "
    "workload",
    "[unit][daemon][store]") {
    TempDir dir;
    auto store = Store::open(dir.path() / "state");
    model::ExpertHeat old_work;
    old_work.counts = {{9, 1, 0}};
    store->add_expert_heat("m", old_work, 1, 10);  // 10 tokens: kept as they are
    CHECK(store->expert_heat("m").counts == std::vector<std::vector<std::uint64_t>>{{9, 1}});
    model::ExpertHeat other;
    other.counts = {{50}};
    store->add_expert_heat("other", other, 1, 10);  // another model's, halved on its own: 25
    // The workload moves to expert 2: 9 + 1 + 4 = 14 > 10 halves everything (1 / 2 = 0 goes).
    model::ExpertHeat new_work;
    new_work.counts = {{0, 0, 4}};
    store->add_expert_heat("m", new_work, 2, 10);
    CHECK(store->expert_heat("m").counts == std::vector<std::vector<std::uint64_t>>{{4, 0, 2}});
    store->add_expert_heat("m", new_work, 3, 10);  // 4 + 6 = 10: not past the cap
    CHECK(store->expert_heat("m").counts == std::vector<std::vector<std::uint64_t>>{{4, 0, 6}});
    for (int i = 0; i < 3; ++i)
        store->add_expert_heat("m", new_work, 4 + i, 10);
    // 4 + 10 = 14 → 2, 5; 2 + 9 = 11 → 1, 4; then 1, 8 (9): the old expert fades, 8 to 1.
    const model::ExpertHeat h = store->expert_heat("m");
    REQUIRE(h.counts.size() == 1);
    CHECK(h.counts[0] == std::vector<std::uint64_t>{1, 0, 8});
    CHECK(store->expert_heat("other").counts == std::vector<std::vector<std::uint64_t>>{{25}});
    // The default cap keeps ordinary runs whole.
    store->add_expert_heat("big", old_work, 1);
    store->add_expert_heat("big", old_work, 2);
    CHECK(store->expert_heat("big").counts == std::vector<std::vector<std::uint64_t>>{{18, 2}});
}

TEST_CASE("the KV demand adds up per model and dtype across runs and skips rows it cannot use",
          "[unit][daemon][store]") {
    TempDir dir;
    model::KvDemand a;
    a.add_step(3000, 1);
    a.add_step(3000, 1);
    a.add_step(40000, 8);
    {
        auto store = Store::open(dir.path() / "state");
        CHECK(store->kv_demand("m", "bf16").empty());
        store->add_kv_demand("m", "bf16", a, 100);
        store->add_kv_demand("m", "bf16", a, 200);
        store->add_kv_demand("m", "fp32", a, 200);
        store->add_kv_demand("m", "bf16", model::KvDemand{}, 300);  // nothing to add
    }
    model::KvDemand twice = a;
    twice.add(a);
    {
        auto store = Store::open(dir.path() / "state");
        CHECK_FALSE(store->report().created);
        CHECK(store->kv_demand("m", "bf16") == twice);
        CHECK(store->kv_demand("m", "fp32") == a);
        CHECK(store->kv_demand("other", "bf16").empty());
    }
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open((dir.path() / "state" / "writescope.db").c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "INSERT INTO kv_demand VALUES ('m', 'bf16', -1, 5, 5, 0), "
                         "('m', 'bf16', 100000, 5, 5, 0), ('m', 'bf16', 7, -3, 1, 0)",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
    CHECK(Store::open(dir.path() / "state")->kv_demand("m", "bf16") == twice);
}

TEST_CASE("the KV demand is halved past its step cap, so the history follows the workload",
          "[unit][daemon][store]") {
    TempDir dir;
    auto store = Store::open(dir.path() / "state");
    model::KvDemand old_shape;
    for (int i = 0; i < 7; ++i)
        old_shape.add_step(100000, 1);
    old_shape.add_step(500, 1);
    store->add_kv_demand("m", "bf16", old_shape, 1, 10);  // 8 steps: kept as they are
    CHECK(store->kv_demand("m", "bf16") == old_shape);
    model::KvDemand new_shape;
    for (int i = 0; i < 6; ++i)
        new_shape.add_step(2000, 1);
    store->add_kv_demand("m", "bf16", new_shape, 2, 10);  // 14 > 10: every count halved
    const model::KvDemand h = store->kv_demand("m", "bf16");
    CHECK(h.steps() == 3 + 3);  // 7 / 2 and 6 / 2; the single 500-token step is gone
    CHECK(h.buckets.count(model::KvDemand::bucket_of(500)) == 0);
    CHECK(h.buckets.at(model::KvDemand::bucket_of(2000)).steps == 3);
    // Another model's counts are its own.
    store->add_kv_demand("n", "bf16", new_shape, 3, 10);
    CHECK(store->kv_demand("n", "bf16") == new_shape);
    CHECK(store->kv_demand("m", "bf16").steps() == 6);
}

TEST_CASE("a schema version 1 store is migrated to the current version keeping its rows",
          "[unit][daemon][store]") {
    TempDir dir;
    const auto state = dir.path() / "state";
    std::filesystem::create_directories(state);
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open((state / "writescope.db").c_str(), &db) == SQLITE_OK);
    // Version 1 as the previous release made it: every table of the initial schema.
    REQUIRE(sqlite3_exec(db,
                         "CREATE TABLE calibrations (id INTEGER PRIMARY KEY, fingerprint TEXT NOT "
                         "NULL, geometry TEXT NOT NULL, dtype TEXT NOT NULL, software_version "
                         "TEXT NOT NULL, a REAL NOT NULL, b REAL NOT NULL, delta REAL NOT NULL, "
                         "a_r2 REAL NOT NULL, b_r2 REAL NOT NULL, cpu_intercept REAL NOT NULL, "
                         "has_gpu INTEGER NOT NULL, points TEXT NOT NULL, seconds_taken REAL NOT "
                         "NULL, created_at INTEGER NOT NULL);"
                         "CREATE TABLE workload_history (model TEXT NOT NULL, dtype TEXT NOT "
                         "NULL, batch_bucket INTEGER NOT NULL, context_bucket INTEGER NOT NULL, "
                         "a REAL NOT NULL, b REAL NOT NULL, delta REAL NOT NULL, r_target REAL "
                         "NOT NULL, r_deployed REAL NOT NULL, steps INTEGER NOT NULL, "
                         "step_seconds_mean REAL NOT NULL, step_seconds_stddev REAL NOT NULL, "
                         "step_seconds_min REAL NOT NULL, step_seconds_max REAL NOT NULL, "
                         "policy_state TEXT NOT NULL, updated_at INTEGER NOT NULL, PRIMARY KEY "
                         "(model, dtype, batch_bucket, context_bucket));"
                         "CREATE TABLE samples (id INTEGER PRIMARY KEY, at_ms INTEGER NOT NULL, "
                         "steps INTEGER NOT NULL, sequences INTEGER NOT NULL, a REAL NOT NULL, b "
                         "REAL NOT NULL, delta REAL NOT NULL, r_target REAL NOT NULL, r_deployed "
                         "REAL NOT NULL, step_seconds_mean REAL NOT NULL);"
                         "INSERT INTO samples VALUES (1, 5, 1, 1, 0, 0, 0, 1, 1, 0);"
                         "PRAGMA user_version = 1;",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
    auto store = Store::open(state);
    CHECK(store->report().migrated_from == 1);
    CHECK(store->report().schema_version == Store::kSchemaVersion);
    CHECK(store->report().schema_version == 3);
    CHECK(store->sample_count() == 1);
    CHECK(store->expert_heat("any").counts.empty());
    CHECK(store->kv_demand("any", "bf16").empty());
    CHECK(count_bad_files(state) == 0);
}
