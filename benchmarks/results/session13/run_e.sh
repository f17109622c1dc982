#!/bin/bash
# session 13 run e: the quantizer limiter probe and the SWAR form (helper-written script)
bash benchmarks/results/session13/quant_probe.sh > /dev/null 2>&1
