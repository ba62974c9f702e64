// Waiting for a condition in a test: polls it until it holds or a deadline passes, so a test
// takes as long as the condition needs (not a guessed sleep) and fails clearly when it never
// comes.
#pragma once

#include <chrono>
#include <thread>

namespace writescope::test {

// True as soon as done() is; false when it still is not after `timeout`. done() is called at
// least once, and once more at the deadline.
template <class Condition>
bool wait_until(Condition&& done, std::chrono::milliseconds timeout = std::chrono::seconds(20),
                std::chrono::milliseconds every = std::chrono::milliseconds(5)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        if (done()) return true;
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(every);
    }
}

}  // namespace writescope::test
