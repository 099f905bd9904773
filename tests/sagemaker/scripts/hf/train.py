"""The Hugging Face SageMaker notebooks' train.py (huggingface/notebooks sagemaker/01_getting_started_pytorch
and 06_sagemaker_metrics), with the transformers Trainer replaced by a stand-in that prints what the
Trainer prints: one dict per logging step ({'loss': ..., 'learning_rate': ..., 'epoch': ...}) and one per
evaluation ({'eval_loss': ..., 'eval_accuracy': ..., 'epoch': ...}), plus a plain "loss: x" line.
The values are fixed so the test knows them: loss 1/(epoch+1), eval_loss 0.6-0.1*epoch,
eval_accuracy 0.6+0.1*epoch.
"""
import argparse
import logging
import os
import sys
import time

if __name__ == "__main__":

    parser = argparse.ArgumentParser()

    # hyperparameters sent by the client are passed as command-line arguments to the script.
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--eval_batch_size", type=int, default=64)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--model_name", type=str)
    parser.add_argument("--learning_rate", type=str, default=5e-5)

    # Data, model, and output directories
    parser.add_argument("--output_data_dir", type=str, default=os.environ["SM_OUTPUT_DATA_DIR"])
    parser.add_argument("--model_dir", type=str, default=os.environ["SM_MODEL_DIR"])
    parser.add_argument("--n_gpus", type=str, default=os.environ["SM_NUM_GPUS"])
    parser.add_argument("--training_dir", type=str, default=os.environ["SM_CHANNEL_TRAIN"])
    parser.add_argument("--test_dir", type=str, default=os.environ["SM_CHANNEL_TEST"])

    args, _ = parser.parse_known_args()

    # Set up logging
    logger = logging.getLogger(__name__)

    logging.basicConfig(
        level=logging.getLevelName("INFO"),
        handlers=[logging.StreamHandler(sys.stdout)],
        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s",
    )

    train_files = sorted(os.listdir(args.training_dir))
    test_files = sorted(os.listdir(args.test_dir))
    logger.info(f" loaded train_dataset length is: {len(train_files)}")
    logger.info(f" loaded test_dataset length is: {len(test_files)}")
    logger.info(f" model_name={args.model_name} train_batch_size={args.train_batch_size}")

    eval_result = {}
    for epoch in range(1, args.epochs + 1):
        loss = round(1.0 / (epoch + 1), 4)
        logger.info(f"epoch {epoch} loss: {loss:.4f}")
        print({"loss": loss, "learning_rate": float(args.learning_rate), "epoch": float(epoch)}, flush=True)
        eval_result = {"eval_loss": round(0.6 - 0.1 * epoch, 4), "eval_accuracy": round(0.6 + 0.1 * epoch, 4),
                       "epoch": float(epoch)}
        print(eval_result, flush=True)
        time.sleep(0.2)

    # writes eval result to file which can be accessed later in s3 ouput
    with open(os.path.join(args.output_data_dir, "eval_results.txt"), "w") as writer:
        print(f"***** Eval results *****")
        for key, value in sorted(eval_result.items()):
            writer.write(f"{key} = {value}\n")

    # Saves the model to s3
    with open(os.path.join(args.model_dir, "pytorch_model.bin"), "wb") as fh:
        fh.write(b"\0" * 16)
