"""Concepts the encoder and the detectors see, and the words they stand for."""
