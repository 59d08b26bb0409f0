"""Training chatcore's models: corpora, tokenizer, forward and reverse language models."""
