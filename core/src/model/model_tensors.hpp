// The tensors a model of a given config has, by their Hugging Face names, with their shapes and
// where each lands in ModelWeights. One list serves loading (validation against the files),
// random generation and saving, so the three cannot disagree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "writescope/core/model/model.hpp"

namespace writescope::model::detail {

struct TensorSlot {
    std::string name;
    std::vector<std::int64_t> shape;  // (rows, cols) for a matrix, (n) for a vector
    Matrix* matrix = nullptr;         // exactly one of the two is set
    Vector* vector = nullptr;
    bool is_norm = false;  // a norm's weight (random models draw it near 1)
};

// Lists every tensor of the first `layers` layers (and the embedding, final norm and head), in
// the order transformers' state dict has them, and sets the shapes in w. reset: w's layers and
// experts are (re)sized empty first; otherwise they must already be sized for the config and
// their data pointers are kept.
std::vector<TensorSlot> tensor_slots(const ModelConfig& c, ModelWeights& w, int layers,
                                     bool reset = true);

}  // namespace writescope::model::detail
