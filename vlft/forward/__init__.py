"""What the model computes on a batch, for training and generation alike: batches and their rows
(batching), samples packed end to end and the attention that keeps them apart (packing), image
groups and the row layout (image_groups), a shared prefix read once (prefix_attention), and the
loss over answer tokens (loss). generation/ and training/ both stand on it; it imports neither."""
