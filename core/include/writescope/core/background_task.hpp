// One persistent thread that runs one task at a time for its owner: start(f) hands f over and
// returns, join() waits for it and rethrows what it threw. For work that must overlap the
// caller's own (the engine attending the second part of a layer while the model computes on the
// first) without a thread created per call.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

namespace writescope {

class BackgroundTask {
  public:
    BackgroundTask() : thread_([this] { loop(); }) {}
    ~BackgroundTask() {
        {
            std::lock_guard lock(m_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }
    BackgroundTask(const BackgroundTask&) = delete;
    BackgroundTask& operator=(const BackgroundTask&) = delete;

    // Runs f on the thread. One task at a time: std::logic_error while one is pending.
    void start(std::function<void()> f) {
        {
            std::lock_guard lock(m_);
            if (pending_) throw std::logic_error("BackgroundTask: a task is still pending");
            task_ = std::move(f);
            pending_ = true;
            error_ = nullptr;
        }
        cv_.notify_all();
    }
    // Waits for the task started last (nothing if none) and rethrows what it threw.
    void join() {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return !pending_; });
        if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    }
    bool pending() const {
        std::lock_guard lock(m_);
        return pending_;
    }

  private:
    void loop() {
        std::unique_lock lock(m_);
        for (;;) {
            cv_.wait(lock, [&] { return stop_ || (pending_ && task_); });
            if (stop_ && !(pending_ && task_)) return;
            std::function<void()> f = std::move(task_);
            task_ = nullptr;
            lock.unlock();
            std::exception_ptr e;
            try {
                f();
            } catch (...) {
                e = std::current_exception();
            }
            f = nullptr;
            lock.lock();
            error_ = e;
            pending_ = false;
            cv_.notify_all();
        }
    }

    mutable std::mutex m_;
    std::condition_variable cv_;
    std::function<void()> task_;
    bool pending_ = false, stop_ = false;
    std::exception_ptr error_;
    std::thread thread_;  // last: started once the rest is initialised
};

}  // namespace writescope
