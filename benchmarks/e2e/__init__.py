"""The parts of bench_e2e_cpu.py (tiermoe against llama.cpp on the same checkpoint, CPU only), and of
bench_speculative.py's llama.cpp arms:

- models.py: the models it runs, made once and kept (a make-model checkpoint, its GGUF files);
- worker.py: one side in a process of its own, tiermoe_side.py, llama_side.py or llama_lookup_side.py (llama.cpp's
  prompt-lookup speculative decoding) inside it; side_process.py: the benchmark's end of it;
- llama_cpp.py: the llama-cpp-python wheel (built once, cached), its GGUF converter (convert_gguf.py, run in a
  subprocess; cached_gguf keeps a checkpoint's conversion) and quantiser;
- report.py: the derived figures, the goals and the table it prints.
"""
