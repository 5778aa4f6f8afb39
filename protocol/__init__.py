"""The shared language of master and slaves: tuple layout, hashing, messages, config.

Master and slave import only from here when they need to agree on something;
neither imports the other (paper 003, section IV-A: the two roles talk only by
messages).
"""
