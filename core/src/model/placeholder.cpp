// The model runtime sources; see core/model.cmake.
