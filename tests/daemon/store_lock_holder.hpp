// Another process's lock on a daemon's store, held by the test itself: an exclusive transaction
// on the database file (out of WAL mode, so that it keeps readers out as well) until release().
// A Store opening the file meanwhile waits for it and says so (store.waiting).
#pragma once

#include <sqlite3.h>

#include <catch2/catch.hpp>

#include <filesystem>

#include "store.hpp"

namespace writescope::test {

class StoreLockHolder {
  public:
    // state_dir: the store's directory; a valid store (WAL) is made there first if none is.
    explicit StoreLockHolder(const std::filesystem::path& state_dir) {
        daemon::Store::open(state_dir).reset();
        const int opened = sqlite3_open((state_dir / daemon::Store::kFileName).c_str(), &db_);
        const int locked = opened == SQLITE_OK
                               ? sqlite3_exec(db_, "PRAGMA journal_mode=DELETE; BEGIN EXCLUSIVE;",
                                              nullptr, nullptr, nullptr)
                               : opened;
        if (locked != SQLITE_OK) release();  // the destructor does not run when REQUIRE throws
        REQUIRE(opened == SQLITE_OK);
        REQUIRE(locked == SQLITE_OK);
    }
    StoreLockHolder(const StoreLockHolder&) = delete;
    StoreLockHolder& operator=(const StoreLockHolder&) = delete;
    ~StoreLockHolder() { release(); }
    // Commits and closes; a no-op once released.
    void release() {
        if (!db_) return;
        sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr);
        sqlite3_close(db_);
        db_ = nullptr;
    }

  private:
    sqlite3* db_ = nullptr;
};

}  // namespace writescope::test
