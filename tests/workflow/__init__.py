"""Tests of the whole workflow's promises: the demo, reruns, configs, the plan and its costs, the README's commands, the tree's conventions."""
