#!/bin/bash
set -e
sort -u words.txt | wc -l > count.txt
