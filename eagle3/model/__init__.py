"""The EAGLE-3 draft module and its training-time-test loss."""
