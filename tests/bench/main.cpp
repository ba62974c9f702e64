// writescope-bench: the project's benchmarks, one subcommand each. Not a test: it asserts
// nothing about time; it prints measured rates next to ceilings measured in the same run.
#include <cstdio>
#include <exception>
#include <string_view>

namespace writescope::bench {
int run_cpu_attention(int argc, char** argv);
int run_experts(int argc, char** argv);
#if WRITESCOPE_BENCH_DECODE
int run_decode(int argc, char** argv);
int run_model_decode(int argc, char** argv);
#endif
#if WRITESCOPE_BENCH_TEXT
int run_tokenize(int argc, char** argv);
#endif
#if WRITESCOPE_BENCH_GPU_MODEL
int run_generate(int argc, char** argv);
#endif
#if WRITESCOPE_BENCH_CUDA
int run_attention_step(int argc, char** argv);
int run_gpu_attention(int argc, char** argv);
#endif
}  // namespace writescope::bench

namespace {

struct Command {
    const char* name;
    int (*run)(int argc, char** argv);
    const char* what;
};
const Command kCommands[] = {
    {"cpu-attention", &writescope::bench::run_cpu_attention,
     "CPU decode attention over packed KV vs the measured DRAM read bandwidth"},
    {"experts", &writescope::bench::run_experts,
     "the CPU's MoE expert FFNs (bf16, real shapes) at decode batches vs the read bandwidth"},
#if WRITESCOPE_BENCH_DECODE
    {"decode", &writescope::bench::run_decode,
     "whole decode steps through the engine (prefill, then steps): the entry point's overhead"},
    {"model-decode", &writescope::bench::run_model_decode,
     "whole-model CPU decode of the built-in models (cut layers) vs the read bandwidth"},
#endif
#if WRITESCOPE_BENCH_TEXT
    {"tokenize", &writescope::bench::run_tokenize,
     "encode MB/s of the tokenizers (tokenizer.json) vs @huggingface/tokenizers in node"},
#endif
#if WRITESCOPE_BENCH_CUDA
    {"attention-step", &writescope::bench::run_attention_step,
     "one hybrid decode step per layer in every mode vs PCIe, HBM and host read ceilings"},
    {"gpu-attention", &writescope::bench::run_gpu_attention,
     "the GPU decode attention kernels over device-resident KV vs HBM (--host: over PCIe)"},
#endif
#if WRITESCOPE_BENCH_GPU_MODEL
    {"generate", &writescope::bench::run_generate,
     "end-to-end MoE decode in writescope, gpu-only and cpu-only modes vs the host limit"},
#endif
};

void usage(std::FILE* f) {
    std::fputs("usage: writescope-bench <command> [options]   (<command> --help for its options)\n",
               f);
    for (const auto& c : kCommands)
        std::fprintf(f, "  %-16s %s\n", c.name, c.what);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const std::string_view cmd = argv[1];
    if (cmd == "--help" || cmd == "-h") {
        usage(stdout);
        return 0;
    }
    for (const auto& c : kCommands) {
        if (cmd == c.name) {
            try {
                return c.run(argc - 2, argv + 2);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "writescope-bench %s: %s\n", c.name, e.what());
                return 1;
            }
        }
    }
    std::fprintf(stderr, "writescope-bench: unknown command %s\n", argv[1]);
    usage(stderr);
    return 2;
}
