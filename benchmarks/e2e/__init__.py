"""The parts of bench_e2e_cpu.py (tiermoe against llama.cpp on the same checkpoint, CPU only):

- models.py: the models it runs, made once and kept (a make-model checkpoint, its GGUF files);
- worker.py: one side in a process of its own, tiermoe_side.py or llama_side.py inside it;
- llama_cpp.py: the llama-cpp-python wheel (built once, cached), its GGUF converter (convert_gguf.py, run in a
  subprocess) and quantiser;
- report.py: the derived figures, the goals and the table it prints.
"""
