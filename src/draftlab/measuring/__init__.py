"""The one measurement loop and the plain-decoding baselines it compares with."""
