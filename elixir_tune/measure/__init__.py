"""Measuring plans on this machine: short interleaved trials (``trials``), candidate plans of a search to
try (``plans``) and a hardware description recalibrated from what was measured (``calibrate``)."""
