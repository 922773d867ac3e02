"""The study: sweeps over target x draft x K x method x dataset x temperature, a resumable
SQLite results store, and an HTML report with the papers' tables and figures."""
