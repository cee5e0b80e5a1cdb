"""Engine cores in processes of their own (stage 10) and the front ends that drive them."""
