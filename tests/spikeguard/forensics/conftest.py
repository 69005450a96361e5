import os
import sys

# forensics_helpers sits beside this file; make it importable however pytest was started.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
