#include "writescope/core/layer_packer.hpp"

#include <algorithm>
#include <stdexcept>

namespace writescope {

LayerPacker::LayerPacker(std::size_t layers, std::size_t threads) : layers_(layers) {
    if (layers == 0) throw std::invalid_argument("LayerPacker: no layers");
    threads = std::max<std::size_t>(threads, 1);
    threads_.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i)
        threads_.emplace_back([this] { worker(); });
}

LayerPacker::~LayerPacker() {
    flush();
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_)
        t.join();
}

void LayerPacker::submit(std::function<void()> ready, std::function<void(std::size_t)> pack,
                         std::function<void()> done) {
    {
        std::lock_guard lock(mu_);
        jobs_.push_back({next_id_++, std::move(ready), std::move(pack), std::move(done)});
    }
    work_cv_.notify_one();
}

LayerPacker::Job* LayerPacker::pick() {
    Job* best = nullptr;
    for (auto& j : jobs_)
        if (!j.busy && j.next < layers_ && (!best || j.next < best->next)) best = &j;
    return best;
}

bool LayerPacker::reached(std::uint64_t id, std::size_t upto) const {
    for (const auto& j : jobs_) {
        if (j.id > id) break;  // submission order
        if (upto >= layers_ ? !j.finished : j.next < upto) return false;
    }
    return true;
}

void LayerPacker::worker() {
    std::unique_lock lock(mu_);
    for (;;) {
        work_cv_.wait(lock, [&] { return stop_ || pick() != nullptr; });
        Job* j = pick();
        if (!j) return;  // stopping with nothing left
        j->busy = true;
        const std::size_t layer = j->next;
        lock.unlock();
        if (layer == 0 && j->ready) j->ready();  // before its first layer, once
        j->pack(layer);  // the deque only grows at the back and loses finished jobs: j stays
        lock.lock();
        ++j->next;
        if (j->next < layers_) {
            j->busy = false;
        } else {
            lock.unlock();
            if (j->done) j->done();
            lock.lock();
            j->finished = true;
            // Finished jobs leave from the front, so the deque keeps submission order (a job
            // finished behind an unfinished one waits there).
            while (!jobs_.empty() && jobs_.front().finished)
                jobs_.pop_front();
        }
        progress_cv_.notify_all();
        work_cv_.notify_all();
    }
}

void LayerPacker::wait_layer(std::size_t layer) {
    std::unique_lock lock(mu_);
    const std::uint64_t id = next_id_ - 1;
    progress_cv_.wait(lock, [&] { return reached(id, std::min(layer + 1, layers_)); });
}

void LayerPacker::flush() {
    std::unique_lock lock(mu_);
    const std::uint64_t id = next_id_ - 1;
    progress_cv_.wait(lock, [&] { return reached(id, layers_); });
}

}  // namespace writescope
