// Parses each .avsc file given on the command line with Avro's Java Schema.Parser, a new parser per file,
// so a file that names a type defined only in another file fails. Prints "ok <file> <full name>" per file;
// exits 1 at the first file that does not parse. Run with the source launcher (Java 11+):
//   java -cp '<avro, jackson, slf4j jars>' tests/java/ParseSchemas.java schemas/*.avsc
import java.io.File;
import org.apache.avro.Schema;

public class ParseSchemas {
    public static void main(String[] args) throws Exception {
        for (String path : args) {
            try {
                Schema schema = new Schema.Parser().parse(new File(path));
                System.out.println("ok " + path + " " + schema.getFullName());
            } catch (Exception e) {
                System.out.println("FAILED " + path + ": " + e.getMessage());
                System.exit(1);
            }
        }
    }
}
