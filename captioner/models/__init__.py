"""Encoders, attention modules and the two decoder families (SAT LSTM, Transformer)."""
