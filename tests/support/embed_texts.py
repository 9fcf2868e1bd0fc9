"""Texts the encoder tests embed, shared by the contrib-graph and standard-graph tests: nomic's
task prefixes, a long repeated text, a one-letter text, and non-Latin script with emoji."""

TEXTS = ["search_query: A man is eating food.",
         "search_document: A man is eating a piece of bread. " * 12,
         "search_document: The girl is carrying a baby.", "x",
         "日本語のテキストと emoji 🙂, numbers 3.14159 and code: def f(x): return x**2"]
