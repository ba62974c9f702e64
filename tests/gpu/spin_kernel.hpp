// A launcher for tests that need the default stream busy (spin_kernel.cu).
#pragma once

namespace writescope::test {

// Enqueues one single-thread kernel on the legacy default stream that runs for about
// `milliseconds` (the GPU's global timer), so that whatever is queued behind it there runs that
// much later than work on non-blocking streams. False if the launch failed.
bool spin_default_stream(double milliseconds);

}  // namespace writescope::test
