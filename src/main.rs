//! The `kvtier` command line.

fn main() {
    println!("kvtier: the simulator is not built yet");
}
