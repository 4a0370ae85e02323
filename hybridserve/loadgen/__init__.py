"""The load generator and black-box calibration: the E1 agents and calibration shapes sent to
any OpenAI-compatible server over HTTP (`hybridserve agents`, `hybridserve calibrate --url`)."""
