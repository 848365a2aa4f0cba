from vllm_contour.surrogate.train import main

if __name__ == "__main__":
    main()
