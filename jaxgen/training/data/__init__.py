"""Data: corpus sources, a cached memory-mapped token store, packing and the grain iterator.

sources.py    where documents come from: the standard library, text files, JSONL records
chat.py       chat SFT data: JSONL conversations rendered with the chat template, loss on the assistant
preference.py preference pairs: JSONL prompt, chosen and rejected, plain or rendered as chats; bad lines counted
tokens.py     tokenize a corpus once into cached, memory-mapped token files (train and held-out)
pipeline.py   packing token streams into fixed-length examples; the grain iterators over them
"""
