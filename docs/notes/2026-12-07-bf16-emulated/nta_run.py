"""python nta_run.py NTA ARGS...: hybridmoe's CLI with bf16.c built with WEIGHTS_NTA=NTA."""
import sys
import hybridmoe.native.bf16 as b
nta = sys.argv[1]
b.FLAGS[:] = [f if not f.startswith("-DWEIGHTS_NTA") else f"-DWEIGHTS_NTA={nta}" for f in b.FLAGS]
sys.argv = ["hybridmoe"] + sys.argv[2:]
from hybridmoe.cli import main
sys.exit(main())
