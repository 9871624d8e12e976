"""Engine backends behind one protocol (:mod:`harness.engines.protocol`)."""
