"""Request traces (chat, RAG, agents, few-shot, shared prefix, unique), the benchmark that runs
them through the Engine, and the cache-only simulator."""
