"""The LLM stage: its running set, the token batch and its KV rows, token rules, sampling and
guided decoding."""
