"""The throughput model, calibration and the tuner: which draft and which K, here."""
